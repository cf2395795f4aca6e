#!/usr/bin/env bash
# megatok's default policy, uniform chunks and whitespace chunks at the research's 18M shape (d 384, 2/6/2 layers,
# 4096-byte windows, batch 32, 300 steps: configs/replication/gpu-18m.json) on English prose, in one GPU call:
# megatok-replicate --preset gpu-call under a wall-clock budget. Each run's held-out bits per byte and alignment
# reach $OUT/gpu-call/results.md once it is evaluated; every run's metrics rows (held-out rows every 100 steps)
# are copied to $OUT/metrics/ as the study goes and at its end.
#
#   here, once:   PY=.venv/bin/python bash tools/gpu_wheels.sh      # -> .whl/ (the GPU image lacks deepspeed, ...)
#                 bash tools/gpu_study.sh --prepare                 # -> runs/gpu-call/data: the prose corpus and held-out sets (16 MB)
#   there, in a copy of the checkout with .whl/ and runs/gpu-call/data (the device's carry):
#                 OUT=DIR bash tools/gpu_study.sh                   # within 540 s: a 10-minute call
#                 OUT=DIR bash tools/gpu_study.sh --budget-s 270 -- --seeds 1,   # other budget; more replicate args
#   A later call on the same machine resumes (finished runs are kept, a stopped one resumes from its checkpoint).
#   Exit status: megatok-replicate's (0 done, 3 when the budget ran out first, 1 a run failed, 2 bad input,
#   143 when a SIGTERM stopped it: its run stopped at a checkpoint and its tables written first).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-study-out}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-runs/gpu-call}
BUDGET=540 PREPARE=0 EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) PREPARE=1 ;;
    --budget-s) shift; BUDGET=${1:-} ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "gpu_study: unknown argument $1 (--prepare, --budget-s N, -- REPLICATE ARGS)" >&2; exit 2 ;;
  esac
  shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_study: --budget-s wants whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
BUDGET=$(( 10#$BUDGET ))
if [ "$BUDGET" -lt 150 ]; then echo "gpu_study: --budget-s $BUDGET is too short for a run (150 s at least)" >&2; exit 2; fi
STUDY=(-m megatok.cli.replicate --preset gpu-call --work "$WORK" "${EXTRA[@]}")
if [ "$PREPARE" = 1 ]; then
  PYTHON=${PY:-.venv/bin/python}
  "$PYTHON" "${STUDY[@]}" --out "$WORK/out" --prepare-only || exit $?
  # The configs name this checkout's paths (the device's call writes its own); the shards are 62 MB of tar
  # headers and text, rebuilt there from prose.jsonl.gz (14 MB) in seconds: the carry stays near 16 MB.
  rm -rf "$WORK/configs" "$WORK/data/prose_shards"
  du -sh "$WORK/data"
  exit 0
fi
if [ ! -f "$WORK/data/eval_prose.jsonl" ]; then
  echo "gpu_study: no prepared data in $WORK/data (run bash tools/gpu_study.sh --prepare here and carry $WORK)" >&2
  exit 2
fi
mkdir -p "$OUT/metrics"
. tools/gpu_site.sh
gpu_site gpu_study 1
copy_metrics() {  # the methods' runs and a hand-over's sources, named by their path under $WORK
  for m in "$WORK"/runs/*/metrics.jsonl "$WORK"/handover-*/runs/*/metrics.jsonl; do
    [ -f "$m" ] || continue
    rel=${m#"$WORK"/}
    cp "$m" "$OUT/metrics/$(dirname "$rel" | tr / -).jsonl"
  done
}
( while sleep 30; do copy_metrics; done ) > /dev/null 2>&1 &  # its sleep holds no caller's pipe
copier=$!
trap 'pkill -P $copier 2>/dev/null; kill $copier 2>/dev/null; copy_metrics; rm -rf "${SITE:-}"' EXIT  # (gpu_site's trap replaced)
# The study's own budget: what is left of ours, less 20 s for its report and the copies.
LEFT=$(( BUDGET - SECONDS - 20 ))
if [ "$LEFT" -lt 120 ]; then echo "gpu_study: $LEFT s left after start-up: too little for a run" >&2; exit 2; fi
"$PYTHON" "${STUDY[@]}" --out "$OUT/gpu-call" --budget-s "$LEFT" &
study=$!
# A SIGTERM to this script (the call's limit) goes to the study, which stops its run at a checkpoint and
# writes its tables; this script waits for that before its own exit copies the metrics and cleans up.
trap 'kill -TERM $study 2>/dev/null' TERM HUP INT
while :; do  # a trapped signal ends `wait` early: wait again until the study has exited
  wait "$study"; rc=$?
  kill -0 "$study" 2>/dev/null || break
done
echo "gpu_study: exit $rc after $SECONDS s of $BUDGET; results in $OUT/gpu-call, metrics rows in $OUT/metrics"
exit $rc
