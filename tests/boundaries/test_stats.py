"""Boundary-quality statistics: word starts, precision and recall of boundaries against them."""

import math

import torch

from megatok.stats import ratios, row_stats, word_starts
from megatok.vocab import PAD, SEP


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_word_starts_hand_checked():
    text = "Hi, naïve wörld_2x! 日本 a"
    x = torch.tensor([ids(text)])
    got = [i for i, s in enumerate(word_starts(x)[0].tolist()) if s]
    data = text.encode()
    # words: Hi | naïve | wörld | 2x | 日本 | a  (underscore and '!' are punctuation); t = 0 never counts
    want = [data.index(w.encode()) for w in ("naïve", "wörld", "2x", "日本", " a")]
    want[-1] += 1
    assert got == want
    # after SEP a word starts; padding is not a word
    x = torch.tensor([[ord("a"), SEP, ord("b"), PAD]])
    assert word_starts(x)[0].tolist() == [False, False, True, False]


def test_precision_recall_sums_and_ratios():
    text = "one two three"  # word starts at 4 and 8 (t = 0 excluded)
    x = torch.tensor([ids(text) + [PAD, PAD]])
    y = torch.cat([x[:, 1:], torch.tensor([[PAD]])], 1)
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[0, [0, 3, 4, 10, 14]] = True  # 14 is padding: ignored
    ce = torch.zeros(x.shape)
    s = {k: float(v.sum()) for k, v in row_stats(x, y, starts, ce, ce).items()}
    assert s["decisions"] == 3 and s["word_starts"] == 2 and s["word_start_boundaries"] == 1
    r = ratios(s)
    assert r["word_start_precision"] == 1 / 3 and r["word_start_recall"] == 1 / 2
    assert r["boundary_rate"] == 4 / 13 and r["bytes_per_chunk"] == 13 / 4
    assert r["whitespace_boundary_fraction"] == 1 / 2  # the space at 3 has a boundary, the one at 7 not
    # sums without the new keys (older totals) still give the older figures
    old = {k: v for k, v in s.items() if k not in ("decisions", "word_starts", "word_start_boundaries")}
    assert "word_start_precision" not in ratios(old)
    assert math.isnan(ratios({**s, "decisions": 0.0})["word_start_precision"])
