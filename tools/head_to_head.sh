#!/usr/bin/env bash
# A BPE head-to-head on CPU, end to end, on a multilingual corpus:
#   the quickstart corpus + public-domain Bible translations in 7 languages (megatok-make-bible-corpus)
#   -> BPE tokenizer (megatok-train-bpe) -> a BPE token model sized to configs/tiny.json's FLOPs per byte
#   (megatok-match-bpe) -> train it -> train megatok with the periodic head-to-head against it on held-out
#   Bible chapters (the same verses in every language) -> megatok-compare on the Bible and the UDHR
#   held-out sets (tables, plots, per-language tables) into $OUT/compare-bible and $OUT/compare-udhr.
# Environment: OUT (default runs/h2h), VOCAB (4096), CONFIG (configs/tiny.json), NPROC (2), MASTER_PORT (the
# ranks' rendezvous port; default a free one for each run);
# for a variant of the megatok run next to the same BPE run: MEGATOK_NAME (its directory under OUT, default
# megatok; the comparisons go to OUT/compare-<set>-<name>), MEGATOK_SET (--set items for it alone) and
# REUSE_BPE=1 (keep OUT/bpe if it has a checkpoint instead of training it again).
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
MEGATOK_NAME=${MEGATOK_NAME:-megatok}
MEGATOK_SET=${MEGATOK_SET:-}
SUFFIX=$([ "$MEGATOK_NAME" = megatok ] && echo "" || echo "-$MEGATOK_NAME")
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NPROC > 0 ? cores / NPROC : 1 ))}

$PY -m megatok.cli.make_corpus --out data/corpus.jsonl.gz --heldout-out data/heldout_udhr.jsonl
# every 200th chapter: 6 chapters x 7 languages (160 KB), small enough to score at every eval on a CPU
$PY -m megatok.cli.make_bible_corpus --out data/bible.jsonl.gz --heldout-out data/heldout_bible.jsonl --heldout-every 200
if [ ! -f data/shards-multi/manifest.json ] || [ data/corpus.jsonl.gz -nt data/shards-multi/manifest.json ] \
   || [ data/bible.jsonl.gz -nt data/shards-multi/manifest.json ]; then
  $PY -m megatok.cli.build_shards data/corpus.jsonl.gz data/bible.jsonl.gz --out data/shards-multi --val-fraction 0.02 \
    --overwrite
fi
mkdir -p "$OUT"
# each run's rendezvous port: MASTER_PORT, else a free one (the launcher's default, 29500, may be taken)
port() { echo "${MASTER_PORT:-$($PY -c 'from megatok.train.dist import free_port; print(free_port())')}"; }
run() { .venv/bin/deepspeed --num_gpus "$NPROC" --master_port "$(port)" launch/pretrain.py --resume none "$@"; }
if [ "${REUSE_BPE:-0}" = 1 ] && [ -f "$OUT/bpe/checkpoints/latest" ]; then
  # the kept run, its tokenizer and its config as they are: nothing here is trained again
  echo "head_to_head: REUSE_BPE=1: keeping $OUT/bpe ($(cat "$OUT/bpe/checkpoints/latest")) and $OUT/bpe$VOCAB"
else
  $PY -m megatok.cli.train_bpe --data data/shards-multi --vocab-size "$VOCAB" --out "$OUT/bpe$VOCAB" --overwrite \
    --heldout data/heldout_bible.jsonl data/heldout_udhr.jsonl
  $PY -m megatok.cli.match_bpe --config "$CONFIG" --tokenizer "$OUT/bpe$VOCAB" --out "$OUT/bpe-model.json" \
    --run-dir "$OUT/bpe" --set data.shards=data/shards-multi
  run --config "$OUT/bpe-model.json" "$@"
fi
read -ra megatok_set <<< "$MEGATOK_SET"  # one --set item per word, never glob-expanded
run --config "$CONFIG" --set train.run_dir="$OUT/$MEGATOK_NAME" data.shards=data/shards-multi \
  eval.heldout=data/heldout_bible.jsonl eval.baseline_run="$OUT/bpe" "${megatok_set[@]}" "$@"

for set in bible udhr; do
  $PY -m megatok.cli.compare "$OUT/$MEGATOK_NAME" "$OUT/bpe" --out "$OUT/compare-$set$SUFFIX" \
    --heldout "data/heldout_$set.jsonl" --tokenizer "$OUT/bpe$VOCAB/tokenizer.model"
done
