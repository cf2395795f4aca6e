"""TrainMetrics (megatok.train.metrics) on its own, in this process, on the real model's outputs: a training
row's figures, the micro-batches with a non-finite loss counted and left out, the time excluded from the
throughput, and the cumulative bytes and FLOPs it carries across a resume (its state)."""

import time

import pytest
import torch

from megatok.model import build_model
from megatok.train.metrics import TrainMetrics, interval_flops
from tests.train.conftest import random_batch, tiny_config


def test_a_row_averages_the_finite_micro_batches_and_bytes_and_flops_carry_across_a_resume(single_rank, shards,
                                                                                           tmp_path):
    cfg = tiny_config(shards, tmp_path)
    model = build_model(cfg)
    a, b, bad = (model(t[:, :-1], t[:, 1:]) for t in (random_batch(cfg, s) for s in (1, 2, 3)))
    bad.loss = bad.loss * float("nan")
    metrics = TrainMetrics(cfg, single_rank, 1)
    metrics.begin()
    assert [bool(metrics.add_output(out)) for out in (a, bad, b)] == [True, False, True]
    metrics.add("bad_shards", 3)
    metrics.add("skipped_steps", 1)
    with metrics.paused():  # an evaluation, a save: not training time
        time.sleep(0.5)
    row = metrics.row(1, lr=0.5, grad_norm=2.0, epoch=0)

    stats = [{k: v.item() for k, v in out.stats.items()} for out in (a, b)]
    targets = stats[0]["targets"] + stats[1]["targets"]
    assert row["loss"] == pytest.approx((a.loss.item() + b.loss.item()) / 2, rel=1e-12)
    assert row["lm_loss"] == pytest.approx((a.terms["lm_loss"].item() + b.terms["lm_loss"].item()) / 2, rel=1e-12)
    assert (row["step"], row["lr"], row["grad_norm"], row["epoch"]) == (1, 0.5, 2.0, 0)
    assert (row["nonfinite_losses"], row["bad_shards"], row["skipped_steps"]) == (1, 3, 1)
    assert row["bytes_seen"] == targets and row["bytes_per_s"] > targets / 0.5  # the pause is not counted
    sums = {k: stats[0][k] + stats[1][k] for k in ("targets", "positions", "chunks")}
    assert row["flops"] == pytest.approx(interval_flops(cfg, sums), rel=1e-12)
    assert torch.isfinite(torch.tensor(row["tflops_per_device"])) and row["host_peak_rss_gib"] > 0

    resumed = TrainMetrics(cfg, single_rank, 1)
    resumed.load_state_dict(metrics.state_dict())
    assert metrics.state_dict() == {"bytes_seen": row["bytes_seen"], "flops": row["flops"]}
    resumed.add_output(a)
    resumed.add("bad_shards", 3)  # the trainer adds both before every row
    resumed.add("skipped_steps", 0)
    later = resumed.row(2, lr=0.5, grad_norm=None)
    assert later["bytes_seen"] == targets + stats[0]["targets"] and later["nonfinite_losses"] == 0
    assert later["flops"] == pytest.approx(row["flops"] + interval_flops(cfg, stats[0]), rel=1e-12)
    assert later["loss"] == pytest.approx(a.loss.item(), rel=1e-12) and later["grad_norm"] is None


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the TensorBoard event files under ``folder`` (TFRecord: length, its CRC,
    an Event proto, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_scalars_hold_every_training_row(shards, tmp_path):
    """logging.tensorboard: a 10-step run's event files hold its 10 training rows' figures, as its metrics file."""
    from megatok.metrics import read_metrics
    from tests.conftest import TINY, pretrain

    run = tmp_path / "tb"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "train.max_steps=10", "train.micro_batch_size=2", "train.global_batch_size=2", "logging.tensorboard=true"])
    rows = [r for r in read_metrics(run) if r.get("split") == "train"]
    scalars = read_scalars(run / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 11))
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert len(scalars["train/bpb"]) == 10 and len(scalars["train/lr"]) == 10
