#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the whole test suite, multi-process DeepSpeed tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export WANDB_MODE=disabled DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest -q "$@"
