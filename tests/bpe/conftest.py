"""A small BPE tokenizer trained once per session for the tests in tests/bpe."""

from __future__ import annotations

import pytest

from megatok import bpe
from tests.conftest import stdlib_texts

MULTILINGUAL = ("All human beings are born free and equal in dignity and rights. "
                "Все люди рождаются свободными и равными. 人人生而自由，在尊严和权利上一律平等。 "
                "सभी मनुष्यों को गौरव और अधिकारों के मामले में जन्मजात स्वतन्त्रता प्राप्त है। "
                "يولد جميع الناس أحرارًا متساوين في الكرامة والحقوق. ")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """(processor, training texts as bytes): vocabulary 700, trained on stdlib code and a multilingual line."""
    texts = [t.encode() for t in stdlib_texts(n_files=12, max_bytes=20_000)] + [MULTILINGUAL.encode() * 20]
    out = tmp_path_factory.mktemp("bpe")
    info = bpe.train_bpe(texts, out, 700)
    return bpe.load_tokenizer(info["model"]), texts
