"""A tiny sentencepiece BPE model trained once per test process from the standard library's text."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from tests.conftest import stdlib_texts

# 256 byte-fallback pieces + <unk>, <s>, </s> + every character of the text (about 90) come before any
# merge, so sentencepiece refuses fewer than ~350 pieces with byte_fallback=True: 400 leaves ~50 merges.
VOCAB_SIZE = 400


@lru_cache(maxsize=1)
def tiny_bpe_model() -> str:
    from megatok.bpe import train_bpe

    tmp = Path(tempfile.mkdtemp(prefix="megatok-bpe-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    docs = [text.encode() for text in stdlib_texts(n_files=30, max_bytes=20_000)]
    # sentencepiece's default coverage keeps rare characters (é) out of the pieces: they fall back to bytes
    return train_bpe(docs, tmp / "tiny.model", VOCAB_SIZE, character_coverage=0.9995,
                     shuffle_input_sentence=False)["model"]
