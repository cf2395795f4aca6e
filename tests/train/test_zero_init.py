"""ZeRO-3 builds the model already partitioned (deepspeed.zero.Init, train.zero_init): on 2 CPU ranks
the gathered weights equal a plain build's bit for bit for every boundary strategy, and the build
adds about half the host memory a whole copy does. Training from such a build is checked in
test_distributed.py (ZeRO-3 against 1 rank, and exact resume)."""

import re

import pytest

from megatok.boundaries import available
from megatok.config import load_config
from megatok.sizing import build_meta_model
from tests.conftest import run_tool

pytestmark = pytest.mark.dist

# 29M parameters: large enough that model memory stands out of the MiB rounding.
MODEL = ["model.d_model=768", "model.n_heads=12", "model.n_encoder_layers=1", "model.n_main_layers=2",
         "model.n_decoder_layers=1"]
ROW = re.compile(r"^(\w+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+(.+)$", re.M)


def largest_module_mib(strategy: str) -> float:
    """fp32 MiB of the module with the most parameters of its own (a qkv projection here)."""
    model = build_meta_model(load_config("configs/tiny.json", MODEL + [f"boundary.strategy={strategy}"]))
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * 4 / 2**20


def check(*args) -> dict[str, tuple[int, int, int, str]]:
    r = run_tool("zero_init_check", "--config", "configs/tiny.json", *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {m[1]: (int(m[2].replace(",", "")), int(m[3].replace(",", "")), int(m[4].replace(",", "")), m[5].strip())
            for m in ROW.finditer(r.stdout)}


def test_partitioned_build_equals_the_plain_build_in_half_the_memory():
    # The bpe strategy has no parameters and needs a tokenizer; every other strategy file is covered.
    strategies = [s for s in available() if s != "bpe"]
    rows = check("--strategies", ",".join(strategies), "--set", *MODEL)
    assert sorted(rows) == sorted(strategies)
    for name, (params, zero_mib, plain_mib, verdict) in rows.items():
        assert verdict == "identical", (name, verdict)
        assert params > 25_000_000
        # fp32: a whole copy is 4 B/param. Each of 2 ranks keeps half, and one module at a time is whole
        # while it is initialised (with DeepSpeed's gather buffers around it): measured 3x its size.
        assert plain_mib >= 0.95 * 4 * params / 2**20, (name, plain_mib)
        assert zero_mib <= plain_mib / 2 + 4 * largest_module_mib(name) + 8, (name, zero_mib, plain_mib)

    rows = check("--strategies", "policy", "--set", "boundary.window=3")  # the windowed policy's extra head
    assert rows["policy"][3] == "identical"


@pytest.mark.parametrize("strategy", ["policy", "hnet"])
def test_whole_build_is_made_on_the_training_device(strategy):
    """Under ZeRO 0-2 the trainer builds the whole model on its device (on a GPU: no fp32 copy on the host).
    The meta device stands in for a GPU here: every parameter and buffer must land on it, and the CPU
    build is the plain one."""
    import torch

    from megatok.dsconfig import deepspeed_config
    from megatok.train.engine import build

    cfg = load_config("configs/tiny.json", ["deepspeed.zero_optimization.stage=2", f"boundary.strategy={strategy}"])
    ds = deepspeed_config(cfg, 1)
    on_meta = build(cfg, ds, torch.device("meta"))
    assert {t.device.type for t in [*on_meta.parameters(), *on_meta.buffers()]} == {"meta"}
    torch.manual_seed(0)
    on_cpu = build(cfg, ds, torch.device("cpu"))
    torch.manual_seed(0)
    plain = build(cfg, ds)
    assert all(torch.equal(a, b) for a, b in zip(on_cpu.state_dict().values(), plain.state_dict().values()))
