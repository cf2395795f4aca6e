"""Checkpoint size on disk: megatok-model-size's estimate per ZeRO stage against the files real runs
write (DeepSpeed's model-states and optimizer files, one step of configs/tiny.json, 740k parameters),
and ``--run`` reporting the measured size of a run's latest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatok import flops, sizing
from megatok.config import load_config
from tests.conftest import ROOT, TINY, pretrain, run_tool

# configs/tiny.json's own width (d_model 128: TINY narrows it to 32, where torch.save's few kB per file
# would be a large part of each file)
WIDE = [t for t in TINY if not t.startswith(("model.d_model", "model.n_heads"))]


def test_estimate_per_stage_by_hand():
    P = 10**9
    bf16 = {s: sizing.checkpoint_bytes(P, stage=s, world=8, bf16=True) for s in range(4)}
    # ZeRO-0: bf16 weights + fp32 master + exp_avg + exp_avg_sq, all in the one model-states file
    assert bf16[0]["model_file"] == bf16[0]["total"] == 14 * P and bf16[0]["optimizer_per_rank"] == 0
    for s in (1, 2):  # bf16 weights in one file, 12 bytes per parameter over the 8 ranks' optimizer files
        assert bf16[s]["model_file"] == 2 * P and bf16[s]["optimizer_per_rank"] == 12 * P / 8
        assert bf16[s]["total"] == 14 * P
    assert bf16[3]["model_file"] == 0 and bf16[3]["total"] == 12 * P  # no whole weights under ZeRO-3
    fp32 = sizing.checkpoint_bytes(P, stage=0, world=8, bf16=False)
    assert fp32["total"] == 12 * P  # fp32 weights are the master: no copy
    assert sizing.checkpoint_bytes(P, stage=2, world=8, bf16=False)["total"] == 16 * P
    table = sizing.checkpoint_table(load_config(ROOT / "configs/7b.json", world_size=8), 8)
    P7 = flops.param_counts(load_config(ROOT / "configs/7b.json", world_size=8))["total"]
    assert table["configured"]["stage"] == 2 and table["configured"]["total"] == 14 * P7
    assert table["export"] == {"fp32": 4 * P7, "bf16": 2 * P7}


def _files(ckpt: Path, suffix: str) -> list[int]:
    return [f.stat().st_size for f in sorted(ckpt.glob(f"*{suffix}"))]


@pytest.mark.dist
@pytest.mark.parametrize("stage, bf16, ranks", [(0, True, 1), (2, False, 2), (3, True, 2)])  # the fp32 master copy, optimizer partitions, no whole weights
def test_estimate_matches_the_files_a_run_writes(tmp_path, shards, stage, bf16, ranks):
    run_dir = tmp_path / "run"
    pretrain(["--config", "configs/tiny.json", "--set", *WIDE, f"data.shards={shards}", f"train.run_dir={run_dir}",
              "train.max_steps=1", "train.micro_batch_size=2", f"train.global_batch_size={2 * ranks}",
              f"deepspeed.zero_optimization.stage={stage}", f"deepspeed.bf16.enabled={str(bf16).lower()}"],
             nproc=ranks)
    cfg = load_config(ROOT / "configs/tiny.json", WIDE, world_size=ranks)
    P = flops.param_counts(cfg)["total"]
    est = sizing.checkpoint_bytes(P, stage=stage, world=ranks, bf16=bf16)
    ckpt = run_dir / "checkpoints" / "step00000001"

    def near(measured: int, estimate: float) -> bool:  # torch.save adds a few kB per file
        return estimate <= measured <= estimate * 1.01 + 32 * 1024

    model_files, optim_files = _files(ckpt, "_model_states.pt"), _files(ckpt, "_optim_states.pt")
    if stage < 3:
        assert len(model_files) == 1 and near(model_files[0], est["model_file"]), (model_files, est)
    else:  # one per rank, shapes only
        assert len(model_files) == ranks and all(size < 64 * 1024 for size in model_files), model_files
    assert len(optim_files) == (ranks if stage else 0)
    assert all(near(size, est["optimizer_per_rank"]) for size in optim_files), (optim_files, est)

    # the command: the run's config at the checkpoint's world size, and the files measured
    r = run_tool("model_size", "--run", run_dir, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["world"]["ranks"] == ranks and rep["checkpoint"]["configured"]["total"] == est["total"]
    measured = rep["measured_checkpoint"]
    assert measured["tag"] == "step00000001" and measured["optimizer_files"] == len(optim_files)
    assert measured["total"] == sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert near(measured["model_states"] + measured["optimizer"], est["total"] + (stage == 3) * sum(model_files))
    r = run_tool("model_size", "--run", run_dir)
    assert r.returncode == 0 and f"measured: {ckpt}: " in r.stdout and f"estimate for ZeRO-{stage} on {ranks} rank(s)" in r.stdout


def test_model_size_run_errors_are_one_line(tmp_path, tiny_run, capsys):
    from megatok.cli.model_size import main  # in this process: three interpreter starts cost more than the test

    assert main(["--run", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("error: ") and "no config.json" in err and "Traceback" not in err
    assert main(["--run", str(tiny_run), "--tag", "step00000099"]) == 2
    err = capsys.readouterr().err
    assert "step00000099" in err and len(err.strip().splitlines()) == 1, err
    assert main(["--run", str(tiny_run)]) == 0
    out = capsys.readouterr().out
    assert "measured: " in out and "step00000003" in out
