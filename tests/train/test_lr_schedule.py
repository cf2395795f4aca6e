"""Warmup-stable-decay in practice: a run trained at a constant rate is branched from a checkpoint into
its decay by resuming a copy with a new max_steps and lr_schedule. The resumed steps follow the new
schedule (the config wins over the scheduler state saved in the checkpoint) and continue the data."""

import shutil

import pytest

from megatok.config import load_config, lr_lambda
from megatok.metrics import read_metrics
from tests.conftest import TINY, pretrain

LR = 1e-3
pytestmark = pytest.mark.dist  # runs the real trainer


def rows(run):
    return {r["step"]: r for r in read_metrics(run) if r.get("split") == "train"}


def test_branch_a_decay_from_a_stable_checkpoint(shards, tmp_path):
    common = ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", "train.micro_batch_size=2",
              "train.global_batch_size=2", f"train.lr={LR}", "train.save_every=4"]
    stable = tmp_path / "stable"
    pretrain(common + [f"train.run_dir={stable}", "train.max_steps=6", "train.lr_schedule=constant"])
    a = rows(stable)
    assert [a[s]["lr"] for s in range(3, 7)] == pytest.approx([LR] * 4)  # after the 2 warmup steps

    branch = tmp_path / "decay"  # the README's recipe: the step-4 checkpoint and the metrics so far
    shutil.copytree(stable / "checkpoints" / "step00000004", branch / "checkpoints" / "step00000004")
    shutil.copy(stable / "metrics.jsonl", branch / "metrics.jsonl")
    decay = ["train.max_steps=7", "train.lr_schedule=wsd", "train.decay_steps=3", "train.min_lr_ratio=0.1"]
    pretrain(["--config", str(stable / "config.json"), "--set", f"train.run_dir={branch}", *decay,
              "--resume", "step00000004"])
    b = rows(branch)
    assert sorted(b) == [1, 2, 3, 4, 5, 6, 7]
    assert [b[s] for s in range(1, 5)] == [a[s] for s in range(1, 5)]  # the stable run's rows up to step 4
    f = lr_lambda(load_config("configs/tiny.json", TINY + decay, world_size=1))
    assert [b[s]["lr"] for s in (5, 6, 7)] == pytest.approx([LR * f(s - 1) for s in (5, 6, 7)])
    assert [round(f(s - 1), 6) for s in (5, 6, 7)] == [0.7, 0.4, 0.1]
    # step 5 saw the same weights and data as the stable run's step 5; only its update differs
    assert b[5]["loss"] == a[5]["loss"]


def test_a_run_ends_part_way_through_a_longer_schedule(shards, tmp_path):
    """train.schedule_steps: the first phase of a hand-over trains 4 steps of an 8-step schedule and ends
    as a run does (its final validation row and checkpoint at step 4)."""
    sets = [*TINY, f"data.shards={shards}", "train.micro_batch_size=2", "train.global_batch_size=2", f"train.lr={LR}",
            "train.max_steps=4", "train.schedule_steps=8", "train.save_every=10"]
    run = tmp_path / "part"
    pretrain(["--config", "configs/tiny.json", "--set", *sets, f"train.run_dir={run}"])
    f = lr_lambda(load_config("configs/tiny.json", sets[:-2] + ["train.max_steps=8"], world_size=1))
    r = rows(run)
    assert [r[s]["lr"] for s in range(1, 5)] == pytest.approx([LR * f(s - 1) for s in range(1, 5)])
    assert r[4]["lr"] > 2 * LR * f(7)  # not decayed: the schedule goes on to step 8
    assert any(x.get("split") == "val" and x["step"] == 4 for x in read_metrics(run))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000004"
