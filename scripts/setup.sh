#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the CPU build of torch and sparkrelay.
# Idempotent: rerunning it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    # The CPU build first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
    python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet numpy
python -m pip install --quiet -e ".[test,bench]"
