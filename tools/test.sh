#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the whole test suite, multi-process DeepSpeed tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export WANDB_MODE=disabled DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=  # CPU figures, also on a GPU machine
# Two workers (pytest-xdist), each test file on one worker so its fixtures are built once, in the
# order tests/conftest.py sets (the files with the most multi-process runs first);
# MEGATOK_TEST_WORKERS=0 runs in one process. Later options win: `bash tools/test.sh -n 0 tests/x.py`.
exec .venv/bin/python -m pytest -q -n "${MEGATOK_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
