"""The BPE token model's size and FLOPs (megatok/flops.py), match_bpe, megatok-match-bpe and the
matched baselines in configs/bpe/: FLOPs per byte by hand, formula = meta-device model, each
configs/bpe/<size>.json within 10% of configs/<size>.json's training FLOPs per byte."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
import math
import os

import pytest

from megatok import flops, sizing
from megatok.config import ConfigError, load_config
from tests.conftest import ROOT, stdlib_texts

BPE_CONFIGS = sorted(p.name for p in (ROOT / "configs" / "bpe").glob("*.json"))


def _load_tool(name):
    return importlib.import_module(f"megatok.cli.{name}")


match_tool = _load_tool("match_bpe")

SMALL_BPE = ["model.kind=bpe", "model.tokenizer=/nonexistent/tokenizer.model", "model.vocab_size=320",
             "model.bytes_per_token=2.5", "model.n_encoder_layers=0", "model.n_decoder_layers=0",
             "model.d_main=64", "model.n_main_heads=2", "model.n_main_layers=3", "data.seq_len=40"]


def test_bpe_flops_per_byte_and_params_by_hand():
    cfg = load_config(ROOT / "configs/tiny.json", SMALL_BPE, world_size=2)
    # width 64, SwiGLU hidden 64 * ceil(64 * 8/3 / 64) = 192, 3 layers, V = 320, T = 40 tokens, 0.4 tokens/byte
    per_token_matmul = 3 * 2 * (64 * 3 * 64 + 64 * 64 + 3 * 64 * 192)   # qkv, out, gate/up/down per layer
    per_token_attention = 3 * 2 * 64 * 41                               # causal QK^T + AV: 2 w (T + 1) per layer
    per_token_head = 2 * 64 * 320                                       # next-token logits
    forward = 0.4 * (per_token_matmul + per_token_attention + per_token_head)
    assert forward == pytest.approx(0.4 * (319_488 + 15_744 + 40_960))
    got = flops.flops_per_byte(cfg)
    assert got["main_matmul"] == pytest.approx(0.4 * per_token_matmul)
    assert got["main_attention"] == pytest.approx(0.4 * per_token_attention)
    assert got["heads"] == pytest.approx(0.4 * per_token_head)
    assert got["byte_matmul"] == got["byte_attention"] == got["projections"] == got["boundary"] == 0
    assert got["forward"] == pytest.approx(forward) and got["training"] == pytest.approx(3 * forward)
    # A realised tokens-per-byte rate replaces 1 / bytes_per_token.
    assert flops.flops_per_byte(cfg, rate=0.25)["forward"] == pytest.approx(forward / 0.4 * 0.25)
    # Parameters: embeddings and the untied head V w each; blocks 4 w^2 + 3 w f + 2 w; the final norm w.
    block = 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
    expect = {"embeddings": 320 * 64, "encoder": 0, "boundary": 0, "main": 3 * block + 64, "decoder": 0,
              "heads": 320 * 64}
    expect["total"] = sum(expect.values())
    assert flops.param_counts(cfg) == expect
    assert flops.meta_param_counts(flops.build_meta_model(cfg)) == expect  # no tokenizer file needed
    # Training bytes are expected bytes: steps x global batch x seq_len tokens x bytes/token.
    assert flops.training_bytes(cfg, 2) == round(cfg.train.max_steps * 16 * 40 * 2.5)
    assert flops.training_flops(cfg, 2) == pytest.approx(3 * forward * cfg.train.max_steps * 16 * 40 * 2.5)
    act = sizing.activation_bytes(cfg)
    assert act["total"] > 0 and sizing.activation_bytes(cfg, checkpointing=True)["blocks"] < act["blocks"]



def test_bpe_matmul_flops_equal_what_torch_counts_in_the_real_forward():
    """The token model's matmul terms per byte (at 1 / bytes_per_token tokens per byte) against torch's
    FlopCounterMode on its real forward over T tokens (attention's SDPA kernel is not counted on a CPU)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megatok.model import build_model

    cfg = load_config(ROOT / "configs/tiny.json", SMALL_BPE, world_size=2)
    T = cfg.data.seq_len
    model = build_model(cfg, sizing_only=True).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 300, (1, T)))
    counted = sum(counter.get_flop_counts()["Global"].values())
    f = flops.flops_per_byte(cfg)
    bytes_in = T * cfg.model.bytes_per_token
    assert counted == pytest.approx(bytes_in * (f["main_matmul"] + f["heads"]), rel=1e-9)

def test_there_is_a_bpe_config_per_size():
    sizes = sorted(p.name for p in (ROOT / "configs").glob("*.json") if p.stem[0].isdigit())
    assert BPE_CONFIGS == sizes == sorted(["100m.json", "350m.json", "1b.json", "3b.json", "7b.json", "13b.json"])


@pytest.mark.parametrize("name", BPE_CONFIGS)
def test_bpe_config_matches_its_unet(name):
    path = ROOT / "configs" / "bpe" / name
    assert json.loads(path.read_text())["extends"] == f"../{name}"
    cfg = load_config(path, world_size=8)
    unet = load_config(ROOT / "configs" / name, world_size=8)
    assert cfg.model.kind == "bpe" and cfg.model.vocab_size == 32000 and cfg.model.bytes_per_token == 4.2
    assert cfg.model.tokenizer == "data/bpe32k/tokenizer.model"
    assert cfg.data.seq_len == round(unet.data.seq_len / 4.2)
    assert cfg.model.main_width // cfg.model.main_heads == unet.model.main_width // unet.model.main_heads
    assert cfg.train.run_dir == unet.train.run_dir + "-bpe"
    assert flops.param_counts(cfg) == flops.meta_param_counts(flops.build_meta_model(cfg))
    ratio = flops.flops_per_byte(cfg)["training"] / flops.flops_per_byte(unet)["training"]
    assert abs(ratio - 1) <= 0.10, ratio
    # Same bytes per run (a sequence covers the same bytes, up to rounding the token count).
    assert flops.training_bytes(cfg, 8) == pytest.approx(flops.training_bytes(unet, 8), rel=0.01)
    # The file is what megatok-match-bpe writes today.
    m = flops.match_bpe(unet, tokenizer="data/bpe32k/tokenizer.model", vocab_size=32000, bytes_per_token=4.2)
    assert {k: getattr(cfg.model, k) for k in m["overrides"]["model"]} == m["overrides"]["model"]
    assert cfg.data.seq_len == m["overrides"]["data"]["seq_len"]
    # matched at another chunk rate: the target is the unet's FLOPs per byte at that rate
    at = flops.match_bpe(unet, tokenizer="t", vocab_size=32000, bytes_per_token=4.2, rate=0.4)
    assert at["target_flops_per_byte"] == flops.flops_per_byte(unet, 0.4)["training"] > m["target_flops_per_byte"]


SHAPES = {
    "tiny": ("configs/tiny.json", []),
    "tiny-narrow-main": ("configs/tiny.json", ["model.d_main=96", "model.n_main_heads=3"]),
    "350m-rate-0.3": ("configs/350m.json", ["boundary.target_rate=0.3"]),
    "1b": ("configs/1b.json", []),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bpt", [2.5, 4.5])
def test_match_bpe_lands_within_10_percent(shape, bpt):
    path, sets = SHAPES[shape]
    cfg = load_config(ROOT / path, sets, world_size=2)
    dm, hd = cfg.model.main_width, cfg.model.main_width // cfg.model.main_heads
    for pieces in (700, 4096):
        r = flops.match_bpe(cfg, tokenizer="tok.model", vocab_size=pieces, bytes_per_token=bpt)
        assert abs(r["ratio"] - 1) <= 0.10, (shape, pieces, bpt, r["ratio"])
        m = r["overrides"]["model"]
        assert m["vocab_size"] == 64 * math.ceil(pieces / 64)
        assert m["d_main"] % 64 == 0 and m["d_main"] % hd == 0 and m["d_main"] // m["n_main_heads"] == hd
        assert dm / 2 - 64 <= m["d_main"] <= 2 * dm
        assert 1 <= m["n_main_layers"] <= 4 * cfg.model.n_main_layers + 4
        assert r["overrides"]["data"]["seq_len"] == round(cfg.data.seq_len / bpt)
        bpe = load_config(ROOT / path, sets + [f"model.{k}={v}" for k, v in m.items()]
                          + [f"data.seq_len={r['overrides']['data']['seq_len']}"], world_size=2)
        assert flops.flops_per_byte(bpe)["training"] == pytest.approx(r["flops_per_byte"])
        assert r["target_flops_per_byte"] == pytest.approx(flops.flops_per_byte(cfg)["training"])
        assert flops.param_counts(bpe)["total"] == r["params"]


def test_match_bpe_refuses_a_bpe_config():
    with pytest.raises(ConfigError, match="unet"):
        flops.match_bpe(load_config(ROOT / "configs/bpe/1b.json", world_size=8), tokenizer="t", vocab_size=100,
                        bytes_per_token=4.0)


# ----------------------------------------------------------------------------- megatok-match-bpe

@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory):
    """A megatok-train-bpe output directory (tokenizer.model + report.json), vocabulary 600."""
    tmp = tmp_path_factory.mktemp("bpe_match")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(stdlib_texts(n_files=10, max_bytes=15_000)))
    out = tmp / "bpe"
    assert _load_tool("train_bpe").main(["--data", str(corpus), "--vocab-size", "600", "--out", str(out)]) == 0
    return out


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.strip() and "[WARNING]" not in line and not line.lower().startswith("warning")]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_tool_writes_a_config_that_loads_from_a_trained_tokenizer(trained_tokenizer, tmp_path, capsys):
    from megatok.model import build_model

    report = json.loads((trained_tokenizer / "report.json").read_text())
    out = tmp_path / "cfgs" / "tiny-bpe.json"
    assert match_tool.main(["--config", str(ROOT / "configs/tiny.json"), "--tokenizer", str(trained_tokenizer),
                            "--out", str(out), "--set", "train.max_steps=7", "data.shards=/x/shards"]) == 0
    printed = capsys.readouterr().out
    assert "training FLOPs/byte" in printed and "ratio" in printed and "params" in printed
    raw = json.loads(out.read_text())
    assert raw["extends"] == os.path.relpath(ROOT / "configs/tiny.json", out.parent)
    cfg = load_config(out, world_size=2)
    m = cfg.model
    assert m.kind == "bpe" and m.tokenizer == str(trained_tokenizer / "tokenizer.model")
    assert m.vocab_size == 64 * math.ceil(report["vocab_size"] / 64)
    assert m.bytes_per_token == report["train"]["bytes_per_token"]
    assert cfg.data.seq_len == round(512 / report["train"]["bytes_per_token"])
    assert cfg.train.run_dir == "runs/tiny-bpe" and cfg.train.max_steps == 7 and cfg.data.shards == "/x/shards"
    unet = load_config(ROOT / "configs/tiny.json", world_size=2)
    ratio = flops.flops_per_byte(cfg)["training"] / flops.flops_per_byte(unet)["training"]
    assert abs(ratio - 1) <= 0.10
    assert f"{ratio:.4f}" in printed
    model = build_model(cfg)  # the real model, reading the tokenizer
    assert int((model.byte_lengths > 0).sum()) > 256
    # --bytes-per-token overrides the report; --run-dir the run directory.
    assert match_tool.main(["--config", str(ROOT / "configs/tiny.json"), "--tokenizer",
                            str(trained_tokenizer / "tokenizer.model"), "--bytes-per-token", "2.5",
                            "--run-dir", "runs/x", "--out", str(out)]) == 0
    cfg = load_config(out, world_size=2)
    assert cfg.model.bytes_per_token == 2.5 and cfg.data.seq_len == round(512 / 2.5) and cfg.train.run_dir == "runs/x"


def test_tool_needs_bytes_per_token_without_a_report(trained_tokenizer, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.model").write_bytes((trained_tokenizer / "tokenizer.model").read_bytes())
    out = tmp_path / "o.json"
    assert match_tool.main(["--config", str(ROOT / "configs/tiny.json"), "--tokenizer", str(bare),
                            "--out", str(out)]) == 2
    assert "--bytes-per-token" in _error_line(capsys) and not out.exists()
    assert match_tool.main(["--config", str(ROOT / "configs/tiny.json"), "--tokenizer", str(bare),
                            "--bytes-per-token", "3", "--out", str(out)]) == 0
    assert load_config(out, world_size=2).model.bytes_per_token == 3


@pytest.mark.parametrize("case", ["missing config", "bpe input", "missing tokenizer", "no sizes"])
def test_tool_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    out = tmp_path / "o.json"
    args = {"missing config": ["--config", str(tmp_path / "nope.json"), "--vocab-size", "32000",
                               "--bytes-per-token", "4"],
            "bpe input": ["--config", str(ROOT / "configs/bpe/1b.json"), "--vocab-size", "32000",
                          "--bytes-per-token", "4"],
            "missing tokenizer": ["--config", str(ROOT / "configs/tiny.json"), "--tokenizer", str(tmp_path / "tok")],
            "no sizes": ["--config", str(ROOT / "configs/tiny.json"), "--vocab-size", "32000"]}[case]
    assert match_tool.main([*args, "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert {"missing config": "nope.json", "bpe input": "unet", "missing tokenizer": "tok",
            "no sizes": "--bytes-per-token"}[case] in line
    assert not out.exists()


def test_tool_with_given_sizes_matches_the_shipped_config(tmp_path, capsys):
    out = tmp_path / "1b.json"
    assert match_tool.main(["--config", str(ROOT / "configs/1b.json"), "--vocab-size", "32000", "--bytes-per-token",
                            "4.2", "--tokenizer-path", "data/bpe32k/tokenizer.model", "--out", str(out)]) == 0
    mine, shipped = json.loads(out.read_text()), json.loads((ROOT / "configs/bpe/1b.json").read_text())
    mine.pop("extends"), shipped.pop("extends")
    assert mine == shipped


def test_tool_never_writes_over_its_source_or_a_config_it_extends(tmp_path, capsys, monkeypatch):
    """--out naming the source (or a file in its extends chain) is refused before anything is written; a
    matched config that does not load leaves an earlier file at --out as it was."""
    (tmp_path / "base.json").write_text(json.dumps({"extends": str(ROOT / "configs/tiny.json")}))
    (tmp_path / "src.json").write_text(json.dumps({"extends": "base.json", "train": {"max_steps": 9}}))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    sizes = ["--vocab-size", "4096", "--bytes-per-token", "3"]
    for out in ("src.json", "base.json"):
        assert match_tool.main(["--config", str(tmp_path / "src.json"), *sizes, "--out", str(tmp_path / out)]) == 2
        line = _error_line(capsys)
        assert f"--out {tmp_path / out}: that is {tmp_path / 'src.json'} or a config it extends" in line, line
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    earlier = tmp_path / "earlier.json"
    earlier.write_text("{}\n")
    from megatok import bpe_config

    real = bpe_config.load_config

    def refuse_the_written(path, *a, **k):  # as if the matched config failed validation
        if Path(path).name.startswith(".earlier.json.tmp-"):
            raise ConfigError(f"{path}: model.main_width: refused")
        return real(path, *a, **k)

    monkeypatch.setattr(bpe_config, "load_config", refuse_the_written)
    assert match_tool.main(["--config", str(tmp_path / "src.json"), *sizes, "--out", str(earlier)]) == 2
    assert "the matched config does not load" in _error_line(capsys)
    assert earlier.read_text() == "{}\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "base.json", "earlier.json", "src.json"]


def test_bytes_per_token_come_from_the_training_text_before_any_held_out_set(tmp_path):
    from megatok.bpe import report_bytes_per_token

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"train": {"bytes_per_token": 3.1}, "heldout": {"udhr": {"bytes_per_token": 4.0}}}))
    assert report_bytes_per_token(report) == 3.1
    report.write_text(json.dumps({"heldout": {"udhr": {"bytes_per_token": 4.0}}}))
    assert report_bytes_per_token(report) == 4.0
    assert report_bytes_per_token(tmp_path / "missing.json") is None
