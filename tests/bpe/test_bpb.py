"""The comparability rule: a token model's bits per byte on a text = its summed token NLL (nats) over the
text's UTF-8 byte count, / ln 2. Shown with a unigram token model estimated from counts, every figure
recomputed here independently of megatok.bpe's sums."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import pytest

from megatok import bpe
from tests.bpe.conftest import MULTILINGUAL

HELD_OUT = ("The cat sat on the mat; le chat était assis. " + MULTILINGUAL[:120] + " 😀 \u2581 end\n")


def unigram(sp, texts: list[bytes]) -> dict[int, Fraction]:
    """p(id) = (count + 1) / (N + V): add-one smoothing over the whole vocabulary, exact fractions."""
    counts = Counter(i for t in texts for i in bpe.encode_bytes(sp, t))
    n, v = sum(counts.values()), sp.get_piece_size()
    return {i: Fraction(counts[i] + 1, n + v) for i in range(v)}


def test_bpb_is_token_nll_over_utf8_bytes(tokenizer):
    sp, texts = tokenizer
    p = unigram(sp, texts)
    assert sum(p.values()) == 1  # a proper distribution over the vocabulary
    data = HELD_OUT.encode("utf-8") + b"\xff\xfe junk"  # invalid UTF-8 is part of the byte count too
    ids = bpe.encode_bytes(sp, data)
    nll = [-math.log(p[i]) for i in ids]

    # independently: the probability of the whole token sequence is the product of the token
    # probabilities (exact rational), its -log2 divided by the number of bytes of the text
    prob = math.prod(p[i] for i in ids)
    bits = -(math.log2(prob.numerator) - math.log2(prob.denominator))
    expected = bits / len(data)

    got = bpe.bpb_from_token_nll(sp, ids, nll)
    assert got["bytes"] == len(data) and got["tokens"] == len(ids)
    assert got["bpb"] == pytest.approx(expected, rel=1e-12)
    assert bpe.token_bpb(math.fsum(nll), len(data)) == pytest.approx(expected, rel=1e-12)
    # more bytes per token means fewer bits per byte for the same per-token cost: the model is a real
    # compressor of this text (a unigram over a 700-piece vocabulary beats 8 bits per byte)
    assert 1.0 < got["bpb"] < 8.0

    # a document separator target (</s>, no bytes) is left out, as megatok leaves SEP out
    eos = sp.eos_id()
    sep = bpe.bpb_from_token_nll(sp, [eos] + ids + [eos], [5.0] + nll + [7.0])
    assert sep["bytes"] == len(data) and sep["bpb"] == pytest.approx(expected, rel=1e-12)

    # per document and overall: sums add up, ratios are taken at the end (corpus bpb, not a mean of bpbs)
    a, b = data[:40], data[40:]
    ia, ib = bpe.encode_bytes(sp, a), bpe.encode_bytes(sp, b)
    ra = bpe.bpb_from_token_nll(sp, ia, [-math.log(p[i]) for i in ia])
    rb = bpe.bpb_from_token_nll(sp, ib, [-math.log(p[i]) for i in ib])
    assert ra["bytes"] + rb["bytes"] == len(data)
    assert bpe.token_bpb(ra["nll"] + rb["nll"], len(data)) == pytest.approx(
        -(sum(math.log2(p[i]) for i in ia + ib)) / len(data), rel=1e-12)


def test_uniform_byte_model_is_eight_bits_per_byte(tokenizer):
    """Text the vocabulary has no piece for is all byte-fallback tokens, one per byte; a model uniform
    over the 256 byte pieces then costs exactly 8 bits per byte, whatever the text's characters."""
    sp, _ = tokenizer
    data = "\U0001F99C\U0001F9A9\u0F00\u16A0".encode() + b"\x80\xff\xc0"
    ids = bpe.encode_bytes(sp, data)
    assert len(ids) == len(data) and all(sp.is_byte(i) for i in ids)
    got = bpe.bpb_from_token_nll(sp, ids, [math.log(256)] * len(ids))
    assert got["bpb"] == pytest.approx(8.0, rel=1e-12)


def test_mismatched_lengths_are_an_error(tokenizer):
    sp, _ = tokenizer
    with pytest.raises(ValueError):
        bpe.bpb_from_token_nll(sp, [1, 2, 3], [0.1, 0.2])
    assert math.isnan(bpe.token_bpb(1.0, 0))
