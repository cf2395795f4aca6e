"""The regression guard: megatok's default policy, trained on the positive control at its strongest level,
learns to start chunks at the spaces before words on every seed it is given, and these are seeds on which the
published estimator (boundary.lr_scale 1, no latch) goes the other way in this very setting: it avoids those
spaces (0.004 of them start a chunk at step 400 on all three), and on one of them (11) the quarter pace without
the latch does too (0.007). A change that breaks the estimator (its sign, its credit, the returns, the rate
term, the sampling) or the latch that holds it until the main network can use a chunk leaves the policy where it
started, and one that breaks its pace lets it wander off; either fails here. The control config as the map
trains it, 400 steps of its 600-step schedule on a 3 MB corpus: about 90 seconds of one core a seed."""

import json

import pytest

from tests.conftest import ROOT, pretrain, run_main

pytestmark = pytest.mark.dist

#: Seeds on which, in this setting, the published estimator avoids the spaces before words and the default
#: aligns by step 290, 290 and 280 (of 10 seeds screened, the default aligned on 9, the published one on 3:
#: docs/replication/notes/2026-12-07-reliable-placement.md).
SEEDS = (11, 12, 19)
STEPS = 400


def test_the_default_policy_aligns_on_the_control_where_the_published_one_does_not(tmp_path, capsys):
    corpus = tmp_path / "control.jsonl.gz"
    assert run_main(capsys, "make_corpus", "--preset", "control", "--level", "1", "--max-mb", "3",
                    "--out", corpus).returncode == 0
    assert run_main(capsys, "build_shards", corpus, "--out", tmp_path / "shards", "--val-fraction", "0.02",
                    "--num-shards", "2", "--no-progress").returncode == 0
    got = {}
    for seed in SEEDS:
        run = tmp_path / f"seed{seed}"
        pretrain(["--config", str(ROOT / "configs/replication/control.json"), "--set", f"train.seed={seed}",
                  f"train.max_steps={STEPS}", "train.schedule_steps=600", f"train.save_every={STEPS}",
                  "eval.max_sequences=32", f"data.shards={tmp_path / 'shards'}", f"train.run_dir={run}",
                  "boundary.strategy=policy"], timeout=900)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r.get("split") == "train"]
        val = next(r for r in rows if r.get("split") == "val" and r["step"] == STEPS)
        assert train[0]["sbw_boundary_fraction"] < 0.4  # it starts near the target rate everywhere
        got[seed] = (train[-1]["sbw_boundary_fraction"], val["val_sbw_boundary_fraction"],
                     train[-1]["bpb_early"] - train[-1]["bpb"])
    # every seed aligned, and it pays: the main network, fed the separator, beats the byte layers by the
    # ending's bits
    assert all(last >= 0.9 and held >= 0.9 and gain > 0.2 for last, held, gain in got.values()), got
