#!/usr/bin/env bash
# Set up (if needed) and run the demo on SmolLM2-135M-Instruct (--model tiny: the bundled toy pair).
# Exit status: the demo's (1 if a check failed).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[demo.sh] set-up first (quick when already done) ..."
bash scripts/setup.sh
. .venv/bin/activate
echo "[demo.sh] running python -m sparkrelay.tools.demo${*:+ $*} (a few minutes on CPU) ..."
python -m sparkrelay.tools.demo "$@"
