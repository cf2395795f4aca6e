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


def stats_for(text: str, positions, pad: int = 0) -> dict:
    x = torch.tensor([ids(text) + [PAD] * pad])
    y = torch.cat([x[:, 1:], torch.tensor([[PAD]])], 1)
    y[0, len(text.encode()) - 1] = ord(".")  # the text's last byte has a target; padding has none
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[0, positions] = True
    ce = torch.zeros(x.shape)
    return {k: float(v.sum()) for k, v in row_stats(x, y, starts, ce, ce).items()}


def test_precision_recall_hand_checked_in_both_conventions():
    text = "one two  three(x)"  # word starts (t >= 1): 4 (two), 9 (three), 15 (x)
    # first-byte convention: "one |two  |three(|x)": all aligned, all hit
    s = stats_for(text, [0, 4, 9, 15])
    assert (s["decisions"], s["word_starts"], s["word_starts_hit"], s["aligned_boundaries"]) == (3, 3, 3, 3)
    # whitespace-before convention: "one| two |three(|x)": the space at 3 precedes "two", the
    # second space at 8 precedes "three"; "(" at 14 is punctuation, not whitespace: not aligned
    s = stats_for(text, [0, 3, 8, 14])
    assert (s["word_starts_hit"], s["aligned_boundaries"]) == (2, 2)
    # the first space of "  " (7) is not right before a word; 1 is inside "one"
    s = stats_for(text, [0, 1, 7, 9])
    assert (s["decisions"], s["word_starts_hit"], s["aligned_boundaries"]) == (3, 1, 1)
    # both conventions at once hit the word once and are both aligned
    s = stats_for(text, [0, 3, 4])
    assert (s["word_starts_hit"], s["aligned_boundaries"]) == (1, 2)


def test_spaces_before_a_word_and_the_words_first_bytes_are_counted_apart():
    text = "one two  three(x)"  # spaces before a word: 3, 8 (not 7); their words' first bytes: 4, 9
    s = stats_for(text, [0, 3, 9, 15])
    assert (s["sbw_positions"], s["sbw_boundaries"], s["wfb_positions"], s["wfb_boundaries"]) == (2, 1, 2, 1)
    r = ratios(stats_for(text, [0, 4, 9]))
    assert (r["sbw_boundary_fraction"], r["wfb_boundary_fraction"]) == (0.0, 1.0)


def test_precision_recall_sums_and_ratios():
    text = "one two three"  # word starts at 4 and 8 (t = 0 excluded)
    s = stats_for(text, [0, 1, 4, 10, 14], pad=2)  # 14 is padding: ignored
    assert s["decisions"] == 3 and s["word_starts"] == 2 and s["word_starts_hit"] == 1
    r = ratios(s)
    assert r["word_start_precision"] == 1 / 3 and r["word_start_recall"] == 1 / 2
    assert r["boundary_rate"] == 4 / 13 and r["bytes_per_chunk"] == 13 / 4
    assert r["whitespace_boundary_fraction"] == 0.0  # no boundary on the spaces at 3 and 7
    # sums without the new keys (older totals) still give the older figures
    old = {k: v for k, v in s.items() if k not in ("decisions", "word_starts", "word_starts_hit", "aligned_boundaries")}
    assert "word_start_precision" not in ratios(old)
    assert math.isnan(ratios({**s, "decisions": 0.0})["word_start_precision"])


def test_sep_targets_are_trained_on_but_not_counted_and_cr_is_whitespace():
    """Packed documents: the SEP between them is a target the model trains on, but bits per byte
    count UTF-8 bytes only (nll and targets leave it out); \\r is whitespace like \\n, \\t and ' '."""
    x = torch.tensor([[SEP, ord("a"), 13, 10, SEP, ord("b"), ord("c")]])
    y = torch.tensor([[ord("a"), 13, 10, SEP, ord("b"), ord("c"), ord("d")]])
    starts = torch.tensor([[1, 0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    ce = torch.arange(1.0, 8.0)[None]
    s = {k: float(v.sum()) for k, v in row_stats(x, y, starts, ce, 2 * ce).items()}
    assert s["targets"] == 6 and s["positions"] == 7
    assert s["nll"] == 28 - 4 and s["nll_early"] == 2 * (28 - 4)  # the SEP target at index 3 is not counted
    assert s["ws_positions"] == 2 and s["ws_boundaries"] == 1  # \r (a boundary) and \n


def test_word_bytes_from_ranges_are_the_tables():
    """stats.word_bytes (the separators' byte ranges, compile-friendly) gives word_byte_table at every id."""
    import torch

    from megatok.stats import word_byte_table, word_bytes
    from megatok.vocab import VOCAB_SIZE

    ids = torch.arange(VOCAB_SIZE)
    assert torch.equal(word_bytes(ids), word_byte_table())
    assert torch.equal(torch.compile(word_bytes, backend="eager", fullgraph=True)(ids), word_byte_table())  # ranges
