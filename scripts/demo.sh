#!/usr/bin/env bash
# Set up (if needed) and run the demo on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m sparkrelay.demo "$@"
