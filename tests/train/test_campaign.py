"""The short fault campaign (tests/train/campaign.py): one fault of every kind, drawn in a shuffled order from
a fixed seed, into 2-rank runs that resume after each; no run lost, no published checkpoint lost, and every
run's losses equal to the uninterrupted run's, bit for bit. (The long campaign's figures: docs/reliability.md.)"""

import os

from tests.train.campaign import KINDS, run_campaign


def test_a_short_fault_campaign_loses_nothing(shards, tmp_path):
    kinds = len(KINDS) if os.geteuid() == 0 else len(KINDS) - 1  # a full disk needs a tmpfs mount (root)
    report = run_campaign(tmp_path / "campaign", shards, faults=kinds, seed=7, per_run=kinds // 2)
    assert report["unexpected"] == []
    assert report["faults"] == kinds and set(report["by_kind"]) == set(KINDS[:kinds])
    assert report["runs"] == report["runs_with_equal_losses"] >= 2
    assert report["runs_lost"] == report["published_checkpoints_lost"] == 0
