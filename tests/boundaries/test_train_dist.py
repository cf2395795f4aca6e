"""Every strategy trains under the real DeepSpeed engine with 2 CPU ranks (ZeRO-2), a few steps each,
and logs its boundary figures; the policy also with model.document_mask."""

import json
import math

import pytest

from megatok.metrics import read_metrics
from tests.boundaries.conftest import POLICY_SECTION, STEPS, train_two_ranks
from tests.boundaries.tokenizer import tiny_bpe_model

pytestmark = pytest.mark.dist

SECTIONS = {
    "policy-estimator-options": POLICY_SECTION,  # the shared policy_run fixture
    "fixed": {"strategy": "fixed"},
    "hnet": {"strategy": "hnet"},
    "gumbel": {"strategy": "gumbel", "temperature": 1.0},
    "uniform": {"strategy": "uniform"},
    "whitespace": {"strategy": "whitespace"},
    "bpe": {"strategy": "bpe"},
    "policy-document-mask": {"strategy": "policy"},
    # the batch baseline over both ranks' micro-batches: one all-reduce in every training step's loss
    "policy-data-parallel-baseline": {"strategy": "policy", "baseline_scope": "data_parallel"},
}


@pytest.mark.parametrize("name", list(SECTIONS))
def test_strategy_trains_on_two_ranks(name, shards, tmp_path, request):
    if name == "policy-estimator-options":
        run = request.getfixturevalue("policy_run")
    else:
        section = dict(SECTIONS[name])
        if name == "bpe":
            section["model_path"] = tiny_bpe_model()
        run = tmp_path / "run"
        train_two_ranks(shards, run, section, *(["model.document_mask=true"] if name.endswith("document-mask") else []))
    rows = read_metrics(run)
    train = [r for r in rows if r.get("split") == "train"]
    val = [r for r in rows if r.get("split") == "val"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert math.isfinite(r["loss"]) and r["nonfinite_losses"] == 0 and r["skipped_steps"] == 0
        assert 0 < r["boundary_rate"] <= 1 and r["bytes_per_chunk"] >= 1
        assert 0 <= r["word_start_precision"] <= 1 and 0 <= r["word_start_recall"] <= 1
    assert val and "val_word_start_recall" in val[-1] and "val_boundary_rate" in val[-1]
    if name in ("hnet", "gumbel"):
        assert all(r["rate_loss"] > 0 for r in train)  # the ratio loss / binomial prior is logged as rate_loss
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step{STEPS:08d}"
    masked = json.loads((run / "config.json").read_text())["model"]["document_mask"]
    assert masked == name.endswith("document-mask")
