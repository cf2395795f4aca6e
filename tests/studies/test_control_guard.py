"""The regression guard: the published policy, trained on the positive control at its strongest level, learns
to start chunks at the spaces before words. A change that breaks the estimator (its sign, its credit, the
returns, the rate term, the sampling) leaves the policy where it started (a fifth of the spaces, as
uniform) and fails here. A small, fast version of configs/replication/control.json (about a minute of
one core); the map in docs/replication/control/ has the full-size runs."""

import json

import pytest

from tests.conftest import ROOT, pretrain, run_main

pytestmark = pytest.mark.dist

STEPS = 350
SMALL = ["model.d_model=32", "model.n_heads=1", "model.d_main=128", "model.n_main_heads=4", "model.n_main_layers=1",
         "data.seq_len=128", "train.micro_batch_size=32", "train.global_batch_size=32", "train.lr=8e-3",
         f"train.max_steps={STEPS}", f"train.save_every={STEPS}", "eval.max_sequences=32"]


def test_the_published_policy_aligns_on_the_control(tmp_path, capsys):
    corpus = tmp_path / "control.jsonl.gz"
    assert run_main(capsys, "make_corpus", "--preset", "control", "--level", "1", "--max-mb", "2",
                    "--out", corpus).returncode == 0
    assert run_main(capsys, "build_shards", corpus, "--out", tmp_path / "shards", "--val-fraction", "0.02",
                    "--num-shards", "2", "--no-progress").returncode == 0
    run = tmp_path / "run"
    pretrain(["--config", str(ROOT / "configs/replication/control.json"), "--set", *SMALL,
              f"data.shards={tmp_path / 'shards'}", f"train.run_dir={run}", "boundary.strategy=policy"], timeout=600)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"]
    val = next(r for r in rows if r.get("split") == "val" and r["step"] == STEPS)
    first, last = train[0], train[-1]
    assert first["sbw_boundary_fraction"] < 0.4  # it starts near the target rate everywhere
    assert last["sbw_boundary_fraction"] >= 0.9 and val["val_sbw_boundary_fraction"] >= 0.9, (last, val)
    # and it pays: the main network, fed the separator, beats the byte layers alone by the ending's bits
    assert last["bpb_early"] - last["bpb"] > 0.2
