python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled
CUDA_LAUNCH_BLOCKING=1 timeout -k 5 110 python3 -m megatok.cli.gpu_check --sections training --configs configs/100m.json --steps 4 --warmup 2 --json-out $OUT/a.json > $OUT/a.log 2>&1; echo "A rc $? at $SECONDS s"
grep -n "misaligned\|triton_\|torchinductor\|line [0-9]*, in" $OUT/a.log | tail -40
f=$(grep -o "/tmp/torchinductor_root/[^\"]*\.py" $OUT/a.log | tail -1); [ -n "$f" ] && cp "$f" $OUT/kernel.py && echo "copied $f"
TORCHINDUCTOR_DIVISIBLE_BY_16=0 timeout -k 5 120 python3 -m megatok.cli.gpu_check --sections training --configs configs/100m.json configs/1b.json --steps 6 --warmup 2 --json-out $OUT/b.json > $OUT/b.log 2>&1; echo "B rc $? at $SECONDS s"
grep -v "^\s*$" $OUT/b.log | grep -v "^\[rank" | tail -25
