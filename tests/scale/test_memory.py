"""The memory model against a real run: peak RSS of 2 CPU ranks under ZeRO-2 in fp32, and under ZeRO-3
in bf16 with fp32 gradient accumulation (the GPU configs' setting).

Method. Each rank of a real ``launch/pretrain.py`` run (deepspeed launcher, 2 ranks, gloo, 2 steps
at seq_len 64) reports its peak resident set size (``ru_maxrss``) at exit, through a
``sitecustomize`` module put on PYTHONPATH (the trainer is not touched). The same run with a
74k-parameter model (in the same precision) is the baseline: interpreter, torch, DeepSpeed, gloo, data and logging. The
difference between the two is the memory attributable to the 29M-parameter model, where model
states dominate (activations at 2 x 64 bytes are about 1% of it), and it is compared with
``model_state_bytes + activation_bytes``.

glibc keeps freed blocks below its (dynamic) mmap threshold in the heap, so the RSS of a process
never falls back and its peak depends on fragmentation, not on what was alive at once.
``MALLOC_MMAP_THRESHOLD_=65536`` makes every block of 64 KiB or more its own mapping, returned to
the OS when freed: peak RSS then follows the peak of live tensors, as a GPU's allocated memory does.
"""

import json

import pytest

from megatok.config import load_config
from megatok.flops import param_counts
from megatok.sizing import activation_bytes, model_state_bytes, zero_kwargs
from tests.conftest import TINY, pretrain

pytestmark = pytest.mark.dist

SITECUSTOMIZE = '''
import atexit, json, os, resource, sys

def _report_peak_rss():
    if sys.argv and sys.argv[0].endswith("pretrain.py") and "RANK" in os.environ:
        out = os.path.join(os.environ["MEGATOK_PEAK_RSS_DIR"], "rank%s.json" % os.environ["RANK"])
        with open(out, "w") as f:
            json.dump({"maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)

atexit.register(_report_peak_rss)
'''

BIG = ["model.d_model=768", "model.n_heads=12", "model.n_encoder_layers=1", "model.n_main_layers=2",
       "model.n_decoder_layers=1"]
SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_main_layers=1",
         "model.n_decoder_layers=1"]
COMMON = TINY + ["train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=4",
                 "data.num_workers=0", "train.save_every=1000"]


PRECISION = {"fp32": [], "bf16": ["deepspeed.bf16.enabled=true", 'deepspeed.data_types={"grad_accum_dtype": "fp32"}']}


def peak_rss(shards, tmp_path, model: list[str], stage: int, precision: str) -> tuple[int, list[str]]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / f"rss-{stage}-{precision}-{model[0]}"
    out.mkdir()
    from tests.conftest import ROOT

    sets = COMMON + model + PRECISION[precision] + [f"data.shards={shards}", f"train.run_dir={out / 'run'}",
                                                     f"deepspeed.zero_optimization.stage={stage}"]
    pretrain(["--config", "configs/tiny.json", "--set", *sets], nproc=2, timeout=240, launcher="deepspeed",
             env={"PYTHONPATH": f"{hook}:{ROOT}", "MEGATOK_PEAK_RSS_DIR": str(out),
                  "MALLOC_MMAP_THRESHOLD_": "65536"})
    ranks = sorted(out.glob("rank*.json"))
    assert len(ranks) == 2, ranks
    return max(json.loads(p.read_text())["maxrss_bytes"] for p in ranks), sets


@pytest.fixture(scope="module")
def baselines(shards, tmp_path_factory):
    """precision -> the small model's peak RSS, measured at first use."""
    cache = {}

    def get(precision):
        if precision not in cache:
            cache[precision] = peak_rss(shards, tmp_path_factory.mktemp("base"), SMALL, 2, precision)[0]
        return cache[precision]
    return get


@pytest.mark.parametrize("stage, precision", [(2, "fp32"), (3, "bf16")])  # both precisions, both partitionings
def test_memory_estimate_within_25_percent_of_measured_peak(stage, precision, baselines, shards, tmp_path):
    peak, sets = peak_rss(shards, tmp_path, BIG, stage, precision)
    baseline = baselines(precision)
    cfg = load_config("configs/tiny.json", sets, world_size=2)
    P = param_counts(cfg)["total"]
    kw = zero_kwargs(cfg)
    assert kw["grad_accum_fp32"] == (precision == "bf16")
    states = model_state_bytes(P, stage=stage, world=2, bf16=precision == "bf16", **kw)
    estimate = states["device"] + activation_bytes(cfg)["total"]
    measured = peak - baseline
    print(f"\nZeRO-{stage}, 2 ranks, {precision}, {P:,} params: estimate {estimate / 2**20:.0f} MiB "
          f"({estimate / P:.1f} B/param), measured {measured / 2**20:.0f} MiB ({measured / P:.1f} B/param; "
          f"peak {peak / 2**20:.0f} MiB - baseline {baseline / 2**20:.0f} MiB), ratio {estimate / measured:.2f}")
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)
