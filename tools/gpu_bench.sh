#!/usr/bin/env bash
# The GPU figures in one call on one GPU, most important first, within a stated budget:
#   1. trainer   megatok-gpu-check --sections trainer: launch/pretrain.py on configs/100m.json as users run
#                it (compiled) under ZeRO-3 built partitioned, a resume in a new process with the losses
#                compared, megatok-generate on the result, 2 steps under ZeRO-2 built on the GPU
#   2. training  megatok-gpu-check --sections generation training attention: generation's step modes
#                (the cached step, the static step, the static step as a CUDA graph: texts compared,
#                bytes/s) on small models, then bf16 MFU, bytes/s and peak memory (against
#                megatok-model-size's estimate) of 1b, 100m, 1b with the document mask and 1b without
#                compile; then flash-attn against SDPA. --quick: 1b's figures, then generation's
#   3. bench     (not --quick) megatok-bench on the GPU: FlexAttention against the dense document mask,
#                the share of the host sync, MFU against a matmul
#
#   here, once (the GPU image has torch but not pydantic, webdataset, deepspeed):
#       PY=.venv/bin/python bash tools/gpu_wheels.sh                      # -> .whl/
#   there, in a copy of the checkout with .whl/:
#       OUT=DIR bash tools/gpu_bench.sh              # in 540 s: a 10-minute slot
#       OUT=DIR bash tools/gpu_bench.sh --quick      # in 270 s: a 5-minute slot (the trainer, 1b, generation)
#       bash tools/gpu_bench.sh [--quick] --plan     # the parts and their time, nothing run
#   --budget-s N: another total; --cpu-smoke: the same parts on a CPU with a tiny config (the tests)
#   what it writes: $OUT/environment.txt, plan.txt, and per part <part>.json and <part>.log
#   exit status: 0 when every part ended or used up its time (its JSON holds what it finished); 1 when a part
#   failed (the later parts still run; the last lines name it); 143 on SIGTERM
#
# The budget: 20 s for start-up (installing .whl/, the environment), 10 s per part for a part that must be
# killed after its SIGTERM, 5% margin; the rest is shared out (trainer 50%, training 35%, bench 15%; --quick:
# 55% / 45%), and a part that ends early leaves its time to the next. (The first H200 run, 2026-12-04: the
# trainer part took 146 s to its step-2 checkpoint, 79% of a 40% share, before the resume, generation and
# ZeRO-2 runs; training's rows compiled and ran 1b and 100m in 58 s.) Each part runs under `timeout` until
# its share ends; its command keeps to that share less 20 s (--budget-s: it starts no new piece after it)
# and writes its JSON after every piece and on SIGTERM, so a part cut short keeps what it measured. A
# SIGTERM to this script reaches the running part the same way.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-bench-out}
PYTHON=${PYTHON:-python3}
BUDGET=540 QUICK=0 PLAN=0 SMOKE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; BUDGET=270 ;;
    --plan) PLAN=1 ;;
    --cpu-smoke) SMOKE=1 ;;
    --budget-s) shift; BUDGET=${1:?--budget-s needs a number of seconds} ;;
    *) echo "gpu_bench: unknown argument $1 (--quick, --plan, --budget-s N, --cpu-smoke)" >&2; exit 2 ;;
  esac
  shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_bench: --budget-s wants whole seconds, got $BUDGET" >&2; exit 2 ;; esac

START_S=20 KILL_S=10 REPORT_S=20
if [ "$QUICK" = 1 ]; then PARTS=(trainer training); SHARES=(55 45); else PARTS=(trainer training bench); SHARES=(50 35 15); fi
N=${#PARTS[@]}
USABLE=$(( BUDGET - START_S - KILL_S * N - BUDGET / 20 ))
if [ "$USABLE" -lt $(( 60 * N )) ]; then
  echo "gpu_bench: --budget-s $BUDGET leaves $USABLE s for $N parts; give at least $(( (60 * N + START_S + KILL_S * N) * 20 / 19 + 1 ))" >&2
  exit 2
fi
ENDS=() end=$START_S
for i in "${!PARTS[@]}"; do end=$(( end + USABLE * SHARES[i] / 100 )); ENDS+=("$end"); done

CMD=()
command_for() {  # CMD: the part's command, given its own budget in seconds
  local part=$1 budget=$2
  CMD=("$PYTHON" -m megatok.cli.gpu_check)
  if [ "$SMOKE" = 1 ]; then CMD+=(--cpu-smoke); fi
  case "$part" in
    trainer) CMD+=(--sections trainer --trainer-steps "$([ "$QUICK" = 1 ] && echo 2 || echo 4)") ;;
    training)  # (--cpu-smoke: gpu_check's own tiny config in place of --configs)
      if [ "$QUICK" = 1 ]; then
        CMD+=(--sections training generation --steps 4 --warmup 2 --no-document-mask --no-compile --no-deterministic)
        if [ "$SMOKE" = 0 ]; then CMD+=(--configs configs/1b.json); fi
      else
        CMD+=(--sections generation training attention --steps 8 --warmup 3)
        if [ "$SMOKE" = 0 ]; then CMD+=(--configs configs/1b.json configs/100m.json); fi
      fi ;;
    bench)
      CMD=("$PYTHON" -m megatok.cli.bench --quick)
      if [ "$SMOKE" = 1 ]; then CMD+=(--device cpu --shapes tiny); else CMD+=(--device cuda --shapes tiny 100m); fi ;;
  esac
  CMD+=(--budget-s "$budget" --json-out "$OUT/$part.json")
}

plan() {
  echo "gpu_bench: budget $BUDGET s = $START_S s start-up + $USABLE s for the parts + $(( KILL_S * N )) s for" \
       "kills + $(( BUDGET - START_S - USABLE - KILL_S * N )) s margin"
  local from=$START_S
  for i in "${!PARTS[@]}"; do
    local share=$(( ENDS[i] - from ))
    command_for "${PARTS[i]}" $(( share - REPORT_S ))
    echo "part $(( i + 1 )) ${PARTS[i]}: until ${ENDS[i]} s ($share s at most, more if earlier parts end early):" \
         "${CMD[*]}"
    from=${ENDS[i]}
  done
}
if [ "$PLAN" = 1 ]; then plan; exit 0; fi

mkdir -p "$OUT"
plan | tee "$OUT/plan.txt"
. tools/gpu_site.sh
gpu_site gpu_bench "$([ "$SMOKE" = 0 ] && echo 1 || echo 0)"  # the smoke runs here, on this machine's packages

child="" FAILED=()
trap 'echo "gpu_bench: SIGTERM: ending the running part (it writes what it measured)" >&2;
      [ -n "$child" ] && kill -TERM "$child" 2>/dev/null && wait "$child"; exit 143' TERM
for i in "${!PARTS[@]}"; do
  part=${PARTS[i]} left=$(( ENDS[i] - SECONDS ))
  if [ "$left" -lt $(( REPORT_S + 20 )) ]; then
    echo "== $part: skipped, $left s left of its time"
    continue
  fi
  echo "== $part ($left s, until ${ENDS[i]} s)"
  command_for "$part" $(( left - REPORT_S ))
  timeout -s TERM -k "$KILL_S" "$left" "${CMD[@]}" > "$OUT/$part.log" 2>&1 &
  child=$!
  wait "$child"
  rc=$? child=""
  echo "$part exit $rc$([ "$rc" = 124 ] && echo ' (its time ran out: the JSON holds what it finished)') at $SECONDS s"
  tail -n 25 "$OUT/$part.log"
  case "$rc" in 0|124) ;; *) FAILED+=("$part (exit $rc)") ;; esac
done
echo "gpu_bench: done in $SECONDS s of $BUDGET; results in $OUT"
if [ "${#FAILED[@]}" -gt 0 ]; then  # every part ran that could; the status says some failed
  echo "gpu_bench: failed: ${FAILED[*]} (their logs: $OUT/PART.log)" >&2
  exit 1
fi
