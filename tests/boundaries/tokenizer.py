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
    from megatok.boundaries.bpe import train_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="megatok-bpe-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    lines = [line for text in stdlib_texts(n_files=30, max_bytes=20_000) for line in text.splitlines()]
    return str(train_tokenizer(lines, tmp / "tiny.model", VOCAB_SIZE, shuffle_input_sentence=False))
