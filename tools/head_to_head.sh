#!/usr/bin/env bash
# A BPE head-to-head on CPU, end to end, on the quickstart's corpus:
#   BPE tokenizer (tools/train_bpe.py) -> a BPE token model sized to configs/tiny.json's FLOPs per byte
#   (tools/match_bpe.py) -> train it -> train megatok with the periodic head-to-head against it on the
#   parallel UDHR held-out set -> tools/compare.py (table, plots, per-language table) into $OUT/compare.
# Environment: OUT (default runs/h2h), VOCAB (4096), CONFIG (configs/tiny.json), NPROC (2).
# Extra arguments go to both training runs (for example: --set train.max_steps=50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PY=.venv/bin/python
export WANDB_MODE=${WANDB_MODE:-offline}
OUT=${OUT:-runs/h2h}
VOCAB=${VOCAB:-4096}
CONFIG=${CONFIG:-configs/tiny.json}
NPROC=${NPROC:-2}
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NPROC > 0 ? cores / NPROC : 1 ))}

$PY tools/make_corpus.py --out data/corpus.jsonl.gz --heldout-out data/heldout_udhr.jsonl
if [ ! -f data/shards/manifest.json ] || [ data/corpus.jsonl.gz -nt data/shards/manifest.json ]; then
  $PY tools/build_shards.py data/corpus.jsonl.gz --out data/shards --val-fraction 0.02 --overwrite
fi
mkdir -p "$OUT"
$PY tools/train_bpe.py --data data/shards --vocab-size "$VOCAB" --out "$OUT/bpe$VOCAB" \
  --heldout data/heldout_udhr.jsonl
$PY tools/match_bpe.py --config "$CONFIG" --tokenizer "$OUT/bpe$VOCAB" --out "$OUT/bpe-model.json" \
  --run-dir "$OUT/bpe"

run() { .venv/bin/deepspeed --num_gpus "$NPROC" launch/pretrain.py --resume none "$@"; }
run --config "$OUT/bpe-model.json" "$@"
run --config "$CONFIG" --set train.run_dir="$OUT/megatok" eval.heldout=data/heldout_udhr.jsonl \
  eval.baseline_run="$OUT/bpe" eval.every=50 "$@"

$PY tools/compare.py "$OUT/megatok" "$OUT/bpe" --out "$OUT/compare" --heldout data/heldout_udhr.jsonl \
  --tokenizer "$OUT/bpe$VOCAB/tokenizer.model"
