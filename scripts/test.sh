#!/usr/bin/env bash
# Set up (if needed) and run the default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff format --check . && ruff check .  # pyproject.toml's [tool.ruff]: formatted, imports sorted, no unused names
python -m pytest -q --durations=25 "$@"  # the 25 slowest tests at the end: what to mark slow next
