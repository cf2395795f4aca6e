"""What the training components' own tests share: this test process as the one rank of a run, and the
tiny model's config and engine, in-process (the integration runs start processes of their own)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY


@pytest.fixture(scope="session")
def process_group() -> torch.device:
    """This test process as the one rank of a job, its process group started once as the trainer starts
    it (megatok.train.dist.init, from the variables a launcher sets, taken back at once: the processes
    other tests start must not inherit them). It lasts the session: DeepSpeed keeps the group it first
    sees for the life of the process. This rank's device."""
    from megatok.train import dist

    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(dist.free_port())}.items():
            mp.setenv(name, value)
        device = dist.init(60)
    yield device
    dist.finish()


@pytest.fixture
def single_rank(process_group, monkeypatch) -> torch.device:
    """:func:`process_group`, with LOCAL_RANK set for the test (DeepSpeed asks for it when it builds an engine)."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    return process_group


def tiny_config(shards: Path, run_dir: Path, *sets: str):
    """configs/tiny.json at the tests' size (TINY), one rank, micro-batches of 2 sequences, one per step."""
    from megatok.config import load_config

    return load_config(ROOT / "configs/tiny.json", [*TINY, f"data.shards={shards}", f"train.run_dir={run_dir}",
                                                    "train.micro_batch_size=2", "train.global_batch_size=2", *sets],
                       world_size=1)


def tiny_engine(cfg, device=None):
    """The trainer's Engine for ``cfg`` (DeepSpeed over the model, built as the trainer builds it: the same
    seed, the same initial weights); needs :func:`single_rank`."""
    from megatok.config import lr_lambda
    from megatok.dsconfig import deepspeed_config
    from megatok.train.engine import Engine, build

    ds_config = deepspeed_config(cfg, 1)
    torch.manual_seed(cfg.train.seed)
    return Engine(build(cfg, ds_config, device), ds_config, cfg.train, lr_lambda(cfg))


def random_batch(cfg, seed: int = 0) -> torch.Tensor:
    """A [micro_batch_size, seq_len + 1] batch of random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), generator=g)


def engine_step(engine, n: int, tokens: torch.Tensor, nonfinite: bool = False) -> int:
    """Optimizer step ``n`` of the Engine on ``tokens`` (the loss made NaN with ``nonfinite``), as the trainer
    takes it; the updates DeepSpeed skipped."""
    engine.begin_step(n - 1)
    out = engine.forward(tokens)
    engine.backward(out.loss * float("nan") if nonfinite else out.loss)
    return engine.end_step(n, nonfinite)
