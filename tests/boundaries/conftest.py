"""A tiny policy run trained by 2 DeepSpeed ranks (ZeRO-2), shared by the 2-rank training test and the
tool tests, so the suite pays for that launch once."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY, pretrain

STEPS = 3
# The "boundary" section replaced whole: configs/base.json carries the policy's options, which other
# strategies would reject as unknown keys. The policy run exercises every estimator option at once.
POLICY_SECTION = {"strategy": "policy", "window": 2, "gamma": 1.0, "batch_baseline": False,
                  "early_exit_reward": False}


def train_two_ranks(shards, run, section: dict, *sets: str) -> None:
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              f"train.max_steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=4",
              "data.num_workers=0", "eval.max_sequences=4", "deepspeed.zero_optimization.stage=2",
              f"boundary={json.dumps(dict(section, target_rate=0.2))}", *sets], nproc=2)


@pytest.fixture(scope="session")
def policy_run(shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("policy2") / "run"
    train_two_ranks(shards, run, POLICY_SECTION)
    return run


def small_model(strategy: str):
    """A 32-wide ByteUNet with the given strategy, in training mode, seeded."""
    from megatok.config import load_config
    from megatok.model.unet import ByteUNet

    cfg = load_config(None, [f"boundary.strategy={strategy}", "model.d_model=32", "model.n_heads=2",
                             "train.micro_batch_size=2"], world_size=1)
    torch.manual_seed(0)
    return ByteUNet(cfg.model, cfg.boundary).train()
