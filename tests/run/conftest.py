"""A wider byte model (2 ranks, ZeRO-2) whose merge memory is measurable."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, pretrain


@pytest.fixture(scope="session")
def wide_run(shards, tmp_path_factory):
    """A byte model of 19M parameters (a main network of 6 layers of width 512), 1 step on 2 ranks under
    ZeRO-2: large enough that a copy of its weights stands out of a process's baseline memory."""
    run = tmp_path_factory.mktemp("wide") / "wide"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "model.d_main=512", "model.n_main_heads=4", "model.n_main_layers=6", "data.seq_len=32",
              "train.max_steps=1", "train.micro_batch_size=2", "train.global_batch_size=4"], nproc=2)
    return run
