# Sourced by tools/gpu_bench.sh and tools/gpu_study.sh on the GPU machine, in the checkout, with PYTHON and OUT set:
#   gpu_site NAME INSTALL   installs .whl/ (tools/gpu_wheels.sh) into a private site directory on PYTHONPATH when
#                           INSTALL is 1 and there are wheels (removed on exit), puts the checkout first on
#                           PYTHONPATH and writes $OUT/environment.txt (the machine, torch, the commit)
gpu_site() {
  local name=$1 install=$2
  if [ "$install" = 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/megatok-site.XXXXXX")  # its own, not a fixed /tmp path another user may hold
    trap 'rm -rf "$SITE"' EXIT
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "$name: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH=$SITE
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
    "$PYTHON" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    git log -1 --format='commit %H %s' 2>/dev/null
  } > "$OUT/environment.txt" 2>&1
  cat "$OUT/environment.txt"
}
