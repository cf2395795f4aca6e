#!/bin/bash
# megatok on N nodes with torchrun instead of the deepspeed launcher (no pdsh/ssh needed): run this
# same command on every node, changing only NODE_RANK.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node-001 bash launch/torchrun_multinode.sh --config configs/1b.json
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node-001 bash launch/torchrun_multinode.sh --config configs/1b.json
#
# Variables: NNODES (default 1), NODE_RANK (default 0), MASTER_ADDR (default localhost; a host every
# node can reach, usually node 0), MASTER_PORT (default 29500), GPUS_PER_NODE (default: the number
# of GPUs nvidia-smi lists, else 8). RDZV=c10d uses torchrun's elastic rendezvous on
# MASTER_ADDR:MASTER_PORT instead of the static one (then NODE_RANK is assigned, not read).
# Everything after the script name goes to launch/pretrain.py. MEGATOK_PRINT_ONLY=1 prints the
# command instead of running it. Under Slurm, prefer LAUNCHER=torchrun launch/slurm/pretrain.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z ${GPUS_PER_NODE:-} ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ $GPUS_PER_NODE -gt 0 ]] || GPUS_PER_NODE=8
fi
VENV=${MEGATOK_VENV:-$PWD/.venv}
if [[ -z ${VIRTUAL_ENV:-} && -f $VENV/bin/activate ]]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

if [[ ${RDZV:-static} == c10d ]]; then
    rdzv=(--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${RDZV_ID:-megatok}")
else
    rdzv=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
cmd=(torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" "${rdzv[@]}" launch/pretrain.py "$@")
if [[ -n ${MEGATOK_PRINT_ONLY:-} ]]; then
    printf 'LAUNCH:'; printf ' %q' "${cmd[@]}"; printf '\n'
else
    exec "${cmd[@]}"
fi
