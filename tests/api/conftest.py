"""Runs the API tests share: a BPE token model (1 rank) and a wider byte model (2 ranks, ZeRO-2) whose
merge memory is measurable. The harness reads local data files only: no hub, no network."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.conftest import PARALLEL, TINY, pretrain, stdlib_texts

# read by datasets and huggingface_hub when they are imported (by lm_eval, in these tests only)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="megatok-test-datasets-"))


@pytest.fixture(scope="session")
def bpe_run(shards, tmp_path_factory):
    """3 steps of a BPE token model (vocabulary 512, 2 layers of width 32) on one rank."""
    from megatok import bpe

    tmp = tmp_path_factory.mktemp("api-bpe")
    texts = [t.encode() for t in stdlib_texts(n_files=10)] + [" ".join(s for v in PARALLEL.values() for s in v).encode()]
    bpe.train_bpe(texts, tmp / "tok", 512)
    run = tmp / "bpe"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "model.kind=bpe", f"model.tokenizer={tmp / 'tok'}", "model.vocab_size=512", "model.bytes_per_token=3.0",
              "model.n_encoder_layers=0", "model.n_decoder_layers=0", "model.n_main_layers=2", "data.seq_len=32",
              "train.max_steps=3", "train.micro_batch_size=2", "train.global_batch_size=2"])
    return run


@pytest.fixture(scope="session")
def wide_run(shards, tmp_path_factory):
    """A byte model of 19M parameters (a main network of 6 layers of width 512), 1 step on 2 ranks under
    ZeRO-2: large enough that a copy of its weights stands out of a process's baseline memory."""
    run = tmp_path_factory.mktemp("api-wide") / "wide"
    pretrain(["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
              "model.d_main=512", "model.n_main_heads=4", "model.n_main_layers=6", "data.seq_len=32",
              "train.max_steps=1", "train.micro_batch_size=2", "train.global_batch_size=4"], nproc=2)
    return run
