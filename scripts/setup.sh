#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the CPU build of torch and sparkrelay.
# Idempotent: rerunning it only installs what is missing. Prints one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "[setup] $*"; }
SECONDS=0
if [ ! -x .venv/bin/python ]; then
    step "1/4 creating the virtual environment .venv with $("$PY" --version 2>&1) ..."
    "$PY" -m venv .venv
else
    step "1/4 virtual environment .venv: already there"
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    # The CPU build first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
    step "2/4 installing torch 2.13.0 (the CPU build): this can take a minute or two ..."
    python -m pip install --quiet "torch==2.13.0"
else
    step "2/4 torch $(python -c 'import torch; print(torch.__version__)'): already installed"
fi
step "3/4 numpy (skipped if installed) ..."
python -m pip install --quiet numpy
step "4/4 sparkrelay in editable mode with its test and benchmark extras (transformers, fastapi, pytest, ...):" \
     "this can take a minute or two the first time ..."
python -m pip install --quiet -e ".[test,bench]"
step "done in ${SECONDS} s: activate with \`. .venv/bin/activate\`"
