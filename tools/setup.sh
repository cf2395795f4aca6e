#!/usr/bin/env bash
# Create .venv (if missing) and install megatok's CPU requirements into it, and megatok itself (editable:
# the megatok-* commands, and launch/pretrain.py imports the checkout's code). Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.megatok-requirements
if [ ! -f "$stamp" ] || ! cat requirements.txt pyproject.toml | cmp -s - "$stamp"; then
  echo "setup: installing requirements into .venv (about a minute the first time)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r requirements.txt
  # (setuptools prints a notice about editable installs through pip on every fresh setup: silenced)
  PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q --no-deps -e . >/dev/null
  cat requirements.txt pyproject.toml > "$stamp"  # a new command in pyproject.toml is installed too
fi
