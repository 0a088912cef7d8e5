#!/usr/bin/env bash
# Set up (if needed) and run the default test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff format --check . && ruff check .  # pyproject.toml's [tool.ruff]: formatted, imports sorted, no unused names
# test files spread over one worker per core plus one, at most 4 (pytest-xdist): a serial run leaves
# much of the cores idle while servers start (docs/reliability.md, "The test suite's time").
# SPARKRELAY_TEST_WORKERS=0 runs it in this process.
workers="${SPARKRELAY_TEST_WORKERS:-$(( $(nproc) + 1 > 4 ? 4 : $(nproc) + 1 ))}"
python -m pytest -q --durations=25 -n "$workers" --dist loadfile "$@"  # the 25 slowest tests: what to mark slow next
