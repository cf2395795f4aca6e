"""Configs, the size calculator and --dry-run: every config loads, its parameter count by formula
equals the real model's (built on the meta device), its name states its size within 10%, and the
FLOPs per byte of a small config match a count by hand."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatok import flops, size_report, sizing
from megatok.config import ConfigError, load_config
from tests.conftest import ROOT, stdlib_texts

CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.json"))
SIZED = [n for n in CONFIGS if re.fullmatch(r"\d+(\.\d+)?[mb]\.json", n)]


def world_for(name: str) -> int:
    return 2 if name == "tiny.json" else 8


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_formula_matches_the_meta_model_per_component(name):
    cfg = load_config(ROOT / "configs" / name, world_size=world_for(name))
    model = flops.build_meta_model(cfg)
    assert next(model.parameters()).device.type == "meta"
    assert flops.param_counts(cfg) == flops.meta_param_counts(model)


def test_formula_matches_for_other_strategies_and_widths(tmp_path):
    from megatok.boundaries import available

    raw = load_config(ROOT / "configs/tiny.json", world_size=2).to_dict()
    checked = []
    for strategy in available():  # strategies this module has no formula for are counted from their module
        (tmp_path / "c.json").write_text(json.dumps({**raw, "boundary": {"strategy": strategy, "target_rate": 0.2}}))
        try:
            cfg = load_config(tmp_path / "c.json", world_size=2)
        except ConfigError:
            continue  # needs options of its own (bpe: a tokenizer file)
        assert flops.param_counts(cfg) == flops.meta_param_counts(flops.build_meta_model(cfg)), strategy
        checked.append(strategy)
    assert {"policy", "fixed"} <= set(checked)
    for sets in (["model.d_main=96", "model.n_main_heads=3"],
                 ["model.n_encoder_layers=0", "model.n_decoder_layers=0", "model.ffn_multiple_of=8"]):
        cfg = load_config(ROOT / "configs/tiny.json", sets, world_size=2)
        assert flops.param_counts(cfg) == flops.meta_param_counts(flops.build_meta_model(cfg)), sets


# configs/100m.json is the published "100M-scale" shape (d 768, 4/12/4 layers), which the paper gives as about
# 147M parameters (docs/method.md, "The published run"): its name is the paper's label, so it is held to that figure.
PUBLISHED = {"100m.json": 147e6}


def _named_size(name: str) -> float:
    if name in PUBLISHED:
        return PUBLISHED[name]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([mb])\.json", name)
    return float(m.group(1)) * (1e6 if m.group(2) == "m" else 1e9)


@pytest.mark.parametrize("name", SIZED)
def test_total_is_within_10_percent_of_the_name(name):
    total = flops.param_counts(load_config(ROOT / "configs" / name, world_size=8))["total"]
    assert abs(total / _named_size(name) - 1) <= 0.10, (name, total)


def test_gpu_configs_put_most_parameters_in_the_main_network():
    for name in SIZED:
        if name == "100m.json":
            continue
        p = flops.param_counts(load_config(ROOT / "configs" / name, world_size=8))
        assert p["main"] / p["total"] > 0.9, name


def test_flops_per_byte_by_hand():
    cfg = load_config(ROOT / "configs/tiny.json", [
        "model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_main_layers=1",
        "model.n_decoder_layers=1", "model.d_main=64", "model.n_main_heads=2", "data.seq_len=50",
        "boundary.target_rate=0.2"], world_size=2)
    # SwiGLU hidden: 64 * ceil(32 * 8/3 / 64) = 128 at width 32; 64 * ceil(64 * 8/3 / 64) = 192 at width 64.
    byte_matmul = 2 * 2 * (32 * 96 + 32 * 32 + 3 * 32 * 128)      # 2 byte-rate layers: qkv, out, gate/up/down
    byte_attention = 2 * 2 * 32 * 51                              # 2 layers x 2 d (T + 1): QK^T + AV, causal
    main_matmul = 0.2 * 2 * (64 * 192 + 64 * 64 + 3 * 64 * 192)   # rho x one main layer
    main_attention = 0.2 * 2 * 64 * (0.2 * 50 + 1)                # rho x 2 dm (K + 1), K = rho T = 10
    projections = 2 * 0.2 * 2 * 32 * 64                           # down and up, both at chunk rate
    boundary = 2 * (32 + 1)                                       # policy head d -> 1 with bias
    heads = 2 * 2 * 32 * 258                                      # next-byte and early-exit logits
    forward = byte_matmul + byte_attention + main_matmul + main_attention + projections + boundary + heads
    assert forward == pytest.approx(128_373.2)
    got = flops.flops_per_byte(cfg)
    assert got["byte_matmul"] == byte_matmul and got["byte_attention"] == byte_attention
    assert got["main_matmul"] == pytest.approx(main_matmul)
    assert got["main_attention"] == pytest.approx(main_attention)
    assert got["projections"] == pytest.approx(projections)
    assert got["boundary"] == boundary and got["heads"] == heads
    assert got["forward"] == pytest.approx(forward)
    assert got["training"] == pytest.approx(3 * forward)
    # A realised rate replaces the target rate; training FLOPs = FLOPs/byte x steps x global batch x seq_len.
    assert flops.flops_per_byte(cfg, rate=0.5)["main_matmul"] == pytest.approx(main_matmul / 0.2 * 0.5)
    assert flops.training_flops(cfg, 2) == pytest.approx(3 * forward * cfg.train.max_steps * 16 * 50)



@pytest.mark.parametrize("strategy, sets", [
    ("fixed", ["model.d_main=64", "model.n_main_heads=2"]),     # widths differ: both projections count
    ("fixed", []),                                              # one width: no projections
    ("policy", ["model.d_main=64", "model.n_main_heads=2"]),    # the boundary head too, at its realised rate
])
def test_matmul_flops_equal_what_torch_counts_in_the_real_forward(strategy, sets):
    """Every matmul term of flops_per_byte against torch's FlopCounterMode on the real model's forward
    (one sequence, so no chunk padding; attention is left out: on a CPU SDPA's kernel is not counted,
    and it is checked by hand above). An up projection counted at byte rate once passed the hand count."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatok.model import build_model

    T = 60
    cfg = load_config(ROOT / "configs/tiny.json", ["model.d_model=32", "model.n_heads=2", f"data.seq_len={T}",
                                                   f'boundary={{"strategy": "{strategy}", "target_rate": 0.2}}',
                                                   *sets], world_size=1)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(torch.randint(0, 256, (1, T)))
    counted = sum(counter.get_flop_counts()["Global"].values())
    assert set(map(str, counter.get_flop_counts()["Global"])) <= {"aten.mm", "aten.addmm", "aten.bmm"}
    rate = out.boundaries.starts.sum().item() / T
    f = flops.flops_per_byte(cfg, rate=rate)
    expected = T * sum(f[k] for k in ("byte_matmul", "main_matmul", "projections", "boundary", "heads"))
    # the formula counts the boundary head's bias as 2 FLOPs per byte; torch's addmm count leaves it out
    assert counted == pytest.approx(expected - 2 * T * (strategy == "policy"), rel=1e-9)

def test_memory_model_follows_zero():
    P = 10**9
    kw = dict(world=8, bf16=True, reduce_bucket=0, prefetch_bucket=0, max_reuse_distance=0)
    per = {s: sizing.model_state_bytes(P, stage=s, **kw)["device"] / P for s in range(4)}
    # 2 (bf16 params) + 2 (grads) + 4 (master) + 4 (fp32 grads) + 8 (AdamW) + 4 (step temporary)
    assert per[0] == pytest.approx(24)
    assert per[1] == pytest.approx(2 + 2 + 2 / 8 + 20 / 8)
    assert per[2] == pytest.approx(2 + 22 / 8)
    assert per[3] == pytest.approx(24 / 8)
    off = sizing.model_state_bytes(P, stage=3, offload_optimizer=True, offload_param=True, **kw)
    assert off["device"] == 2 * P / 8 and off["host"] == pytest.approx(22 * P / 8)
    # ZeRO-2 with the optimizer offloaded: bf16 params and grad partitions stay; the fp32 states and
    # a staging copy of the gradient partition (2 bytes / 8 ranks) go to the host
    off2 = sizing.model_state_bytes(P, stage=2, offload_optimizer=True, **kw)
    assert off2["device"] == pytest.approx(2 * P + 2 * P / 8) and off2["host"] == pytest.approx((20 + 2) * P / 8)
    # fp32 gradient accumulation: ZeRO-2 keeps an fp32 partition and updates from it (no fp32 copy);
    # ZeRO-3's partition is fp32 and the update still copies it; ZeRO-0/1 rows stay (megatok refuses it there)
    acc = {s: sizing.model_state_bytes(P, stage=s, grad_accum_fp32=True, **kw)["device"] / P for s in range(4)}
    assert acc[2] == pytest.approx(2 + 20 / 8) and acc[3] == pytest.approx(26 / 8)
    assert acc[0] == per[0] and acc[1] == per[1]
    fp32 = {**kw, "bf16": False}  # an fp32 model accumulates in fp32 anyway
    assert (sizing.model_state_bytes(P, stage=3, grad_accum_fp32=True, **fp32)
            == sizing.model_state_bytes(P, stage=3, **fp32))
    assert sizing.zero_kwargs(load_config(ROOT / "configs/13b.json", world_size=8))["grad_accum_fp32"]
    assert not sizing.zero_kwargs(load_config(ROOT / "configs/100m.json", world_size=8))["grad_accum_fp32"]
    ckpt = load_config(ROOT / "configs/13b.json", world_size=8)
    assert (sizing.activation_bytes(ckpt, checkpointing=True)["total"]
            < sizing.activation_bytes(ckpt, checkpointing=False)["total"] / 4)


def test_every_gpu_config_fits_an_80gb_gpu_as_configured():
    for name in SIZED:
        m = sizing.memory_table(load_config(ROOT / "configs" / name, world_size=8), 8)["configured"]
        assert m["total_gpu_bytes"] < 60 * 2**30, (name, m["total_gpu_bytes"] / 2**30)


def test_start_up_memory_whole_or_partitioned():
    """ZeRO-3 builds partitioned (train.zero_init): its partition plus one layer on the GPU, nothing whole
    on the host. Otherwise each rank builds the whole model in fp32 on its GPU, nothing on the host."""
    cfg = load_config(ROOT / "configs/13b.json", world_size=8)
    P = flops.param_counts(cfg)["total"]
    m = sizing.memory_table(cfg, 8)["configured"]
    assert m["init_partitioned"] and m["init_host_bytes"] == 0
    assert m["init_gpu_bytes"] == pytest.approx(2 * P / 8 + 2 * sizing.largest_layer_params(cfg))
    whole = sizing.memory_table(load_config(ROOT / "configs/13b.json", ["train.zero_init=false"], world_size=8), 8)
    assert not whole["configured"]["init_partitioned"] and whole["configured"]["init_host_bytes"] == 0
    assert whole["configured"]["init_gpu_bytes"] == 4 * P
    seven = sizing.memory_table(load_config(ROOT / "configs/7b.json", world_size=8), 8)["configured"]
    assert not seven["init_partitioned"] and seven["init_host_bytes"] == 0
    assert seven["init_gpu_bytes"] == 4 * flops.param_counts(load_config(ROOT / "configs/7b.json", world_size=8))["total"]


def _load_tool(name):
    return importlib.import_module(f"megatok.cli.{name}")


def test_model_size_tool_json(capsys):
    assert _load_tool("model_size").main(["--config", "configs/1b.json", "--gpus", "8", "--nodes", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world"]["ranks"] == 16 and rep["params"]["total"] == rep["params_instantiated"]
    assert {row["stage"] for row in rep["memory"]["stages"]} == {0, 1, 2, 3}
    assert rep["training_flops"] == pytest.approx(rep["flops_per_byte"]["training"] * rep["training_bytes"])
    assert rep["batch"]["grad_accum"] == 512 // (16 * 16) and rep["batch"]["global"] == 512
    assert _load_tool("model_size").main(["--config", "configs/1b.json", "--rate", "0.5", "--json"]) == 0
    half = json.loads(capsys.readouterr().out)["flops_per_byte"]
    assert half["main_matmul"] == pytest.approx(2.5 * rep["flops_per_byte"]["main_matmul"])  # 0.5 against 0.2
    assert _load_tool("model_size").main(["--config", "configs/1b.json"]) == 0
    table = capsys.readouterr().out
    assert "| boundary | 1,025 | <0.1% |" in table and "| main | 914,958,336 | 94.7% |" in table  # no "0.0%" shares


def test_dry_run_13b_under_a_minute_without_data_or_process_group():
    t = time.time()
    r = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/13b.json", "--dry-run",
                        "--set", "data.shards=/nonexistent/shards"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")})
    elapsed = time.time() - t
    assert r.returncode == 0, r.stderr[-3000:]
    assert elapsed < 60, elapsed
    assert "instantiated on the meta device: 12,952,993,281" in r.stdout
    ds = json.loads(r.stdout[r.stdout.index("resolved DeepSpeed config"):].split("\n", 1)[1])
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_batch_size"] == 2048
    assert ds["gradient_accumulation_steps"] == 2048 // (8 * 8)


@pytest.mark.parametrize("argv, message", [
    (["-m", "megatok.cli.model_size", "--config", "configs/1b.json", "--gpus", "0"], "argument --gpus: must be > 0, got 0"),
    (["-m", "megatok.cli.model_size", "--config", "configs/1b.json", "--nodes", "-3"], "argument --nodes: must be > 0, got -3"),
    (["-m", "megatok.cli.model_size", "--config", "configs/1b.json", "--rate", "5"], "argument --rate: must be > 0 and <= 1"),
    (["launch/pretrain.py", "--config", "configs/1b.json", "--dry-run", "0"], "argument --dry-run: must be > 0, got 0"),
    (["launch/pretrain.py", "--config", "configs", "--dry-run"], "configs is a directory, not a JSON config"),
])
def test_bad_sizes_and_paths_are_one_line(argv, message):
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_dry_run_reports_config_mistakes_like_the_trainer(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert size_report.dry_run(str(ROOT / "configs/tiny.json")) == 2
    assert capsys.readouterr().err.strip() == "error: WORLD_SIZE: 'abc' is not a whole number"
    monkeypatch.delenv("WORLD_SIZE")
    assert size_report.dry_run(str(ROOT / "configs/tiny.json")) == 2  # 16 sequences do not split over 8 ranks x 8
    assert "global_batch_size" in capsys.readouterr().err
    assert size_report.dry_run(str(ROOT / "configs/tiny.json"), world=2) == 0
    assert '"train_batch_size": 16' in capsys.readouterr().out


def test_model_size_and_dry_run_for_a_bpe_config(capsys, tmp_path):
    """A BPE token-model config (configs/bpe/) is sized like a unet one; its tokenizer is read only by
    --dry-run, and only if it is on the machine."""
    (tmp_path / "bpe").mkdir()
    cfg_path = str(tmp_path / "bpe" / "1b.json")
    Path(cfg_path).write_text(json.dumps({"extends": str(ROOT / "configs/bpe/1b.json"),
                                          "model": {"tokenizer": str(tmp_path / "no-such.model")}}))
    tool = _load_tool("model_size")
    assert tool.main(["--config", cfg_path, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kind"] == "bpe" and rep["seq_unit"] == "tokens" and rep["rate"] == pytest.approx(1 / 4.2)
    assert rep["params"]["total"] == rep["params_instantiated"] and rep["params"]["encoder"] == 0
    assert rep["training_bytes"] == round(46000 * 512 * 975 * 4.2)
    assert rep["memory"]["configured"]["activation_bytes"] > 0
    assert tool.main(["--config", cfg_path]) == 0
    text = capsys.readouterr().out
    assert "tokens per byte (4.2 bytes/token)" in text and "975 tokens x 4.2 bytes/token" in text
    assert tool.main(["--config", cfg_path, str(ROOT / "configs/1b.json")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith("| bpe/1b.json |") and "| 0% |" in rows[2] and rows[3].startswith("| 1b.json |")
    assert size_report.dry_run(cfg_path, world=8) == 0
    out, err = capsys.readouterr()
    assert f"instantiated on the meta device: {rep['params']['total']:,}" in out and "resolved DeepSpeed config" in out
    assert "no-such.model is not on this machine" in err

    # A tokenizer that is here is read, and one with more pieces than model.vocab_size fails as at launch.
    from megatok import bpe

    bpe.train_bpe([t.encode() for t in stdlib_texts(n_files=4)], tmp_path / "tok", 512)
    Path(cfg_path).write_text(json.dumps({"extends": str(ROOT / "configs/bpe/1b.json"),
                                          "model": {"tokenizer": str(tmp_path / "tok"), "vocab_size": 448}}))
    assert size_report.dry_run(cfg_path, world=8) == 2
    assert capsys.readouterr().err.strip().endswith("has 512 pieces, more than model.vocab_size=448")


def test_bpe_configs_fit_an_80gb_gpu_as_configured():
    for name in SIZED:
        m = sizing.memory_table(load_config(ROOT / "configs" / "bpe" / name, world_size=8), 8)["configured"]
        assert m["total_gpu_bytes"] < 60 * 2**30, (name, m["total_gpu_bytes"] / 2**30)


def test_document_mask_activations_count_the_byte_and_chunk_rate_masks():
    """model.document_mask materialises a [T, T] mask per sequence for the encoder and the decoder and
    a [rho T, rho T] one for the main network (bf16 here: 2 bytes each); off, none."""
    cfg = load_config(ROOT / "configs/100m.json", ["model.document_mask=true"], world_size=8)
    B, T, rho = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.boundary.target_rate
    assert cfg.model.n_encoder_layers and cfg.model.n_decoder_layers
    got = sizing.activation_bytes(cfg, bf16=True)
    assert got["masks"] == pytest.approx((2 * B * T * T + B * (rho * T) ** 2) * 2)
    assert sizing.activation_bytes(load_config(ROOT / "configs/100m.json", world_size=8), bf16=True)["masks"] == 0
