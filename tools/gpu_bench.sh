#!/usr/bin/env bash
# The GPU figures in one call on one GPU, within about 8 minutes: megatok-gpu-check (bf16 MFU of
# 100m and 1b under DeepSpeed, the document mask's cost, compile's gain, the trainer's resume check) and
# the benchmark (megatok-bench: its ratios on the GPU, FlexAttention against the dense
# document mask, the chunk capacity without a host sync), each writing JSON and a log to $OUT.
#
#   here, once (the GPU image has torch but not pydantic, webdataset, deepspeed):
#       PY=.venv/bin/python bash tools/gpu_wheels.sh                      # -> .whl/
#   there, in a copy of the checkout with .whl/ (under 10 minutes):
#       OUT=DIR bash tools/gpu_bench.sh
#   what it writes: $OUT/gpu_check.json, gpu_check.log, bench.json, bench.log, environment.txt
#
# Each part has a budget and keeps what it measured when it runs out (gpu_check writes its JSON after every
# section, the bench after its last round), so one part failing or running long costs the other nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-bench-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_bench: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='commit %H %s' 2>/dev/null
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

check=(-m megatok.cli.gpu_check)
echo "== gpu_check (budget 290 s)"
timeout -s TERM 320 python3 "${check[@]}" --configs configs/100m.json configs/1b.json --steps 8 --warmup 3 \
  --trainer-steps 4 --budget-s 290 --json-out "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check exit $?"
tail -n 30 "$OUT/gpu_check.log"

echo "== bench (budget 150 s of rounds)"
timeout -s TERM 200 python3 -m megatok.cli.bench --device cuda --reps 5 --steps 3 --budget-s 150 \
  --json-out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?"
tail -n 40 "$OUT/bench.log"
