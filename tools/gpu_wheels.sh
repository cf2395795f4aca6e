#!/usr/bin/env bash
# Wheels that the GPU check (megatok/perf/gpu_check.py) needs on a GPU machine whose image has torch but not
# megatok's other requirements, and no network: run this here (where pip reaches the registry), carry .whl/
# and the checkout there, and install the wheels there with --no-index. Pinned to requirements.txt; Python
# 3.12, x86-64 Linux by default.
#   bash tools/gpu_wheels.sh                 # -> .whl/ (about 7 MB), ignored by git
#   there, in the checkout: SITE=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl &&
#          PYTHONPATH=$SITE:$PWD python3 -m megatok.cli.gpu_check --json-out gpu_check.json
# DeepSpeed's own dependencies (einops, msgpack, ninja, packaging, psutil, py-cpuinfo, pyyaml, tqdm) come
# too, pinned to the versions tested here: an image may lack any of them. numpy is not carried (torch's
# own must stay). EXTRA="name==version ..." adds more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
OUT=${OUT:-.whl}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p "$OUT"
pin() { grep -E "^$1==" requirements.txt | head -1; }
# DeepSpeed is a source distribution: build its pure-Python wheel here (no ops compiled).
$PY -m pip wheel -q --no-deps -w "$OUT" "$(pin deepspeed)"
platforms=()
for n in 2_17 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d "$OUT" \
  "$(pin pydantic)" pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  "$(pin webdataset)" braceexpand==0.1.7 hjson==3.1.0 \
  einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 packaging==26.4 psutil==7.2.2 py-cpuinfo==9.0.0 PyYAML==6.0.4 \
  tqdm==4.70.1 ${EXTRA:-}
ls -1 "$OUT"
du -sh "$OUT"
