"""The counterfactual probe (megatok.eval.policy_probe, megatok-boundary-value): byte classes, the discounted
loss one added boundary saves, and the command on a trained run."""

import json
import shutil

import pytest
import torch

from megatok.config import load_config
from megatok.eval.policy_probe import (CLASSES, boundary_values, byte_classes, clustered_stderr, discounted_future,
                                      main_context)
from megatok.model import build_model
from megatok.run import checkpoints
from tests.conftest import run_tool


def test_byte_classes_partition_the_decided_positions():
    text = b"Hello  world, it's (x)\n\tdone"
    x = torch.tensor([list(text)])
    c = byte_classes(x)
    total = sum(v.long() for v in c.values())
    assert total[0, 0] == 0 and (total[0, 1:] == 1).all()
    assert c["space_before_word"][0].nonzero().flatten().tolist() == [6, 13, 23]  # not 18: "(" starts no word
    assert c["word_start"][0, 7] and c["inside_word"][0, 8] and c["other"][0, 12]  # "w", "o", ","


def test_discounted_future_against_a_loop():
    d = torch.randn(3, 9)
    t = torch.tensor([0, 4, 8])
    got = discounted_future(d, 0.9, t)
    for i in range(3):
        want = sum(0.9 ** (k - int(t[i])) * float(d[i, k]) for k in range(int(t[i]), 9))
        assert float(got[i]) == pytest.approx(want, rel=1e-6)


def test_the_error_is_counted_by_sequence():
    """Draws of one sequence that share its offset: by draw the error shrinks with the draws, by sequence it
    stays the spread of the sequences' means; independent draws give about the same either way."""
    g = torch.Generator().manual_seed(0)
    groups = [r for r in range(8) for _ in range(50)]
    offsets = torch.randn(8, generator=g)
    shared = offsets[torch.tensor(groups)] + 0.01 * torch.randn(400, generator=g)
    by_draw = float(shared.std() / 400 ** 0.5)
    by_sequence = clustered_stderr(shared, groups)
    assert by_sequence > 5 * by_draw
    assert by_sequence == pytest.approx(float(offsets.std()) / 8 ** 0.5, rel=0.25)
    independent = torch.randn(400, generator=g)
    assert clustered_stderr(independent, groups) == pytest.approx(float(independent.std() / 20), rel=0.35)
    assert clustered_stderr(independent[:50], groups[:50]) != clustered_stderr(independent[:50], groups[:50])  # NaN
    # by hand: two sequences of two draws
    v = torch.tensor([1.0, 3.0, 2.0, 6.0])
    dev = v - 3.0
    assert clustered_stderr(v, [0, 0, 1, 1]) == pytest.approx(((dev[:2].sum() ** 2 + dev[2:].sum() ** 2) ** 0.5 / 4).item())


def tokens(B=4, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = [b"the", b"state", b"of", b"union", b"is", b"strong", b"and", b"we"]
    rows = []
    for _ in range(B):
        s = b" ".join(words[int(i)] for i in torch.randint(0, len(words), (T,), generator=g))[:T + 1]
        rows.append(list(s))
    return torch.tensor(rows)


def test_values_are_zero_when_the_main_network_contributes_nothing_and_match_a_recomputation():
    cfg = load_config("configs/tiny.json", overrides=["data.seq_len=48"])
    torch.manual_seed(0)
    model = build_model(cfg)
    x = tokens()
    res = boundary_values(model, x, gamma=0.9, rounds=2, seed=0)
    assert set(res["classes"]) == set(CLASSES)
    assert all(r["n"] > 0 for r in res["classes"].values())
    assert any(abs(r["value"]) > 1e-6 for r in res["classes"].values())
    assert res["return_std"] > 0
    assert set(res["chunkings"]) == {"sampled", "space_before_word", "uniform_same_rate", "threshold", "forced_only"}
    rates = {k: v["rate"] for k, v in res["chunkings"].items()}
    assert rates["space_before_word"] == pytest.approx(rates["uniform_same_rate"], abs=0.08)
    assert rates["forced_only"] == pytest.approx(1 / 48)  # one chunk per window: t = 0
    assert abs(main_context(res)) > 1e-4  # an untrained main network's output still depends on what it reads
    assert abs(res["main_off_bpb"] - res["chunkings"]["sampled"]["bpb"]) > 1e-4
    with torch.no_grad():
        model.main_norm.weight.zero_()  # the main network's output is 0 whatever the chunks
    res = boundary_values(model, x, gamma=0.9, rounds=2, seed=0)
    assert all(r["value"] == pytest.approx(0, abs=1e-9) for r in res["classes"].values())
    assert len({round(v["bpb"], 9) for v in res["chunkings"].values()}) == 1  # every chunking alike
    assert main_context(res) == pytest.approx(0, abs=1e-9)
    assert res["main_off_bpb"] == pytest.approx(res["chunkings"]["sampled"]["bpb"], abs=1e-9)


@pytest.mark.dist
def test_the_command_on_a_trained_run(tiny_run, tmp_path):
    out = tmp_path / "v.json"
    r = run_tool("boundary_value", "--run", tiny_run, "--rounds", "1", "--batch-size", "2", "--seq-len", "64",
                 "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "space_before_word" in r.stdout and "estimator return noise" in r.stdout
    res = json.loads(out.read_text())
    assert res["checkpoint"] and res["classes"]["space_before_word"]["n"] >= 1
    assert 0 <= res["classes"]["space_before_word"]["started"] <= 1 and res["bytes_seen"] > 0
    c = res["classes"]["space_before_word"]
    assert 1 <= c["sequences"] <= 2 and "stderr_by_draw" in c
    bad = run_tool("boundary_value", "--run", tmp_path / "none")
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


@pytest.mark.dist
def test_the_trend_over_every_kept_checkpoint(tiny_run, tmp_path):
    """--checkpoint all probes each kept checkpoint in training order, with its training bytes, and plots."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ckpts = run / "checkpoints"
    (tag,) = [p.name for p in ckpts.glob("step*")]
    early = ckpts / "step00000001"  # an earlier checkpoint: the same weights, fewer bytes recorded
    shutil.copytree(ckpts / tag, early)
    meta = json.loads((early / "megatok.json").read_text())
    meta["step"], meta["metrics"]["bytes_seen"] = 1, 10.0
    (early / "megatok.json").write_text(checkpoints.meta_text(meta))  # with its own digest, as a save writes it
    out, plot = tmp_path / "trend.json", tmp_path / "trend.png"
    r = run_tool("boundary_value", "--run", run, "--checkpoint", "all", "--rounds", "1", "--batch-size", "2",
                 "--seq-len", "64", "--out", out, "--plot", plot)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [row["checkpoint"] for row in doc["trend"]] == ["step00000001", tag]
    first, last = doc["trend"]
    assert first["bytes_seen"] == 10.0 and last["bytes_seen"] > 10
    assert first["value"] == pytest.approx(last["value"])  # same weights, same batch, same seed
    assert last["ratio"] == pytest.approx(last["value"] / last["return_std"])
    assert first["context"] == pytest.approx(last["context"])  # same weights: the same context
    assert last["context"] == pytest.approx(main_context(doc["checkpoints"][-1]))
    assert "value/noise" in r.stdout and "main network's context" in r.stdout and plot.stat().st_size > 1000
    one = run_tool("boundary_value", "--run", run, "--checkpoint", "step00000001", "--rounds", "1", "--batch-size",
                   "2", "--seq-len", "64", "--out", out)
    assert one.returncode == 0, one.stderr[-2000:]
    assert json.loads(out.read_text())["checkpoint"] == "step00000001"  # the one named, not the latest
    bad = run_tool("boundary_value", "--run", run, "--checkpoint", f"{tag},step00000099")
    assert bad.returncode == 2 and "step00000099" in bad.stderr
