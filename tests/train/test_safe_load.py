"""Checkpoint files are read without running code from them (megatok.run.safe_load): every file DeepSpeed
writes loads under the allow-list, and a file that names anything else is refused with one line before
anything in it runs."""

import glob
from pathlib import Path

import pytest
import torch

from megatok.dsconfig import deepspeed_config
from megatok.run import merge
from megatok.run.checkpoints import CheckpointError
from megatok.run.safe_load import weights_only_loads
from megatok.train.checkpointer import Checkpointer
from tests.train.conftest import engine_step, random_batch, tiny_config, tiny_engine


def saved(shards, run: Path, *overrides) -> Path:
    cfg = tiny_config(shards, run, *overrides)
    engine, saver = tiny_engine(cfg), Checkpointer(cfg.train, 0)
    saver.start(cfg, "auto", deepspeed_config(cfg, 1))
    engine_step(engine, 1, random_batch(cfg, 1))
    tag = saver.save(engine, 1, {"engine": engine.state_dict()}, cursors={})
    saver.release_lock()
    return run / "checkpoints" / tag


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_every_file_deepspeed_writes_loads_under_the_allow_list(single_rank, shards, tmp_path, stage, bf16):
    ckpt = saved(shards, tmp_path / "run", f"deepspeed.zero_optimization.stage={stage}",
                 f"deepspeed.bf16.enabled={str(bf16).lower()}")
    files = sorted(glob.glob(str(ckpt / "*.pt")))
    assert len(files) == (1 if stage == 0 else 2)
    with weights_only_loads():
        for f in files:
            assert isinstance(torch.load(f, map_location="cpu", weights_only=False), dict)  # made weights_only
    assert set(merge.checkpoint_tensors(ckpt)) >= {"embed.weight"} if stage else True


class Payload:
    """What a hostile checkpoint could hold: unpickling it runs a function (here: one that writes a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


@pytest.mark.parametrize("stage", [0, 2])
def test_a_checkpoint_file_holding_code_is_refused_naming_it_and_nothing_runs(single_rank, shards, tmp_path, stage):
    ckpt = saved(shards, tmp_path / "run", f"deepspeed.zero_optimization.stage={stage}")
    states = ckpt / "mp_rank_00_model_states.pt"
    state = torch.load(states, map_location="cpu", weights_only=False)
    marker = tmp_path / "ran"
    torch.save({**state, "payload": Payload(marker)}, states)
    with pytest.raises(CheckpointError) as e:
        merge.checkpoint_tensors(ckpt)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{states}: not loaded: ") and "GLOBAL getattr" in line, repr(line)
    assert not marker.exists()
