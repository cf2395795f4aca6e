"""A run directory someone else wrote runs no command here: where its config.json's data is a ``pipe:``
spec, the tools that read a run's data when no --data is given (megatok-summarize, megatok-boundary-value,
megatok-estimator-variance) refuse in one line, and the command never runs; given as --data, it does."""

import json

import pytest

from megatok.config import load_config
from megatok.data.documents import DataError
from megatok.eval.policy_probe import fixed_batch
from tests.conftest import ROOT


def pipe_config(marker):
    return load_config(ROOT / "configs/tiny.json", [f"data.shards=pipe:touch {marker}; cat /dev/null"], world_size=1)


def test_the_probes_read_no_command_from_a_runs_config(tmp_path):
    marker = tmp_path / "ran"
    cfg = pipe_config(marker)
    with pytest.raises(DataError, match=r"^data.shards of the run's config.json is a command \(pipe:touch .*; "
                                        r"megatok does not run a command read from a run directory"):
        fixed_batch(cfg, None, 2, 64)
    assert not marker.exists()
    with pytest.raises(DataError):  # named as --data, the command runs (and reads no documents here)
        fixed_batch(cfg, f"pipe:touch {marker}; cat /dev/null", 2, 64)
    assert marker.exists()


def test_summarize_reads_no_command_from_a_runs_config(tmp_path):
    from megatok.studies.summarize import summarize

    marker, run = tmp_path / "ran", tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(pipe_config(marker).to_dict()))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train", "loss": 1.0}) + "\n")
    with pytest.raises(DataError, match=r"^data.shards of the run's config.json is a command"):
        summarize(run)
    assert not marker.exists()
