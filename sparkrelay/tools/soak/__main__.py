"""`python -m sparkrelay.tools.soak`: see run.py."""

from sparkrelay.tools.soak.run import main

if __name__ == "__main__":
    raise SystemExit(main())
