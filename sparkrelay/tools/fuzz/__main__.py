"""`python -m sparkrelay.tools.fuzz`: see run.py."""

from sparkrelay.tools.fuzz.run import main

if __name__ == "__main__":
    raise SystemExit(main())
