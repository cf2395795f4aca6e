"""Boundary-quality statistics: word starts, precision and recall of boundaries against them."""

import math

import pytest
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


def test_evaluation_figures_do_not_depend_on_the_batch_size():
    """Documents scored one per batch or several (padded to the widest window) give the same sums: a
    padded row's last real byte, whose target is padding, is not counted as a position or a chunk.
    (A deterministic rule here; sampled boundaries are the next test's.)"""
    from megatok.config import load_config
    from megatok.data.documents import Document
    from megatok.eval.bpb import evaluate_documents
    from megatok.model import build_model
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs/tiny.json", ['boundary={"strategy": "fixed", "target_rate": 0.25}',
                                                   "data.seq_len=32"], world_size=1)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert model.boundary.window == 32  # the training window, which uniform draws over in evaluation too
    texts = [b"a" * n + b" word" for n in (0, 3, 10, 27, 31, 40, 77)]
    docs = [Document(t, "en", "test", f"d{i}") for i, t in enumerate(texts)]

    def run(batch_size):
        return evaluate_documents(model, iter(docs), seq_len=32, batch_size=batch_size, mode="threshold",
                                  seed=0, device=torch.device("cpu"))

    one, four = run(1), run(4)
    assert one["bytes"] == four["bytes"] == sum(map(len, texts))
    for key in ("bytes_per_chunk", "boundary_rate", "whitespace_boundary_fraction", "word_start_recall"):
        assert one[key] == four[key], key
    assert one["bpb"] == pytest.approx(four["bpb"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["policy", "gumbel", "uniform"])
def test_sampled_boundaries_of_a_document_do_not_depend_on_its_batch(strategy):
    """A document's sampled boundaries come from the seed, its bytes and the window's index: the same
    figures one per batch or several, in another order, or next to other documents."""
    from megatok.config import load_config
    from megatok.data.documents import Document
    from megatok.eval.bpb import evaluate_documents
    from megatok.model import build_model
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs/tiny.json", [f'boundary={{"strategy": "{strategy}", "target_rate": 0.25}}',
                                                   "data.seq_len=32"], world_size=1)
    torch.manual_seed(0)
    model = build_model(cfg)
    texts = [b"a" * n + b" word, and more" for n in (0, 3, 10, 27, 31, 40, 77)]
    docs = [Document(t, "en" if i % 2 else "fr", "test", f"d{i}") for i, t in enumerate(texts)]

    def run(documents, batch_size, seed=0):
        return evaluate_documents(model, iter(documents), seq_len=32, batch_size=batch_size, mode="sample",
                                  seed=seed, device=torch.device("cpu"))

    one, four, backwards = run(docs, 1), run(docs, 4), run(docs[::-1], 3)
    french_alone = run(docs[0::2], 2)
    keys = ("bpb", "bytes_per_chunk", "boundary_rate", "whitespace_boundary_fraction", "word_start_recall")
    # boundary figures exactly; bpb to float rounding (a batch's padded width changes the arithmetic)
    for other in (four, backwards):
        for key in keys:
            assert other[key] == pytest.approx(one[key], rel=1e-6 if key == "bpb" else 0), key
    for key in keys:
        assert french_alone[key] == pytest.approx(one["by_lang"]["fr"][key], rel=1e-6 if key == "bpb" else 0), key
    assert run(docs, 1, seed=1)["bytes_per_chunk"] != one["bytes_per_chunk"]  # the seed still matters


def test_windows_of_about_one_length_share_a_batch_and_the_figures_stay():
    """evaluate_documents sorts a buffer of windows by length before cutting it into batches: less padding
    is computed, and the figures are those of batches in the documents' order (to float rounding)."""
    from megatok.config import load_config
    from megatok.data.documents import Document
    from megatok.eval.bpb import evaluate_documents
    from megatok.model import build_model
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs/tiny.json", ["data.seq_len=32"], world_size=1)
    torch.manual_seed(0)
    model = build_model(cfg)
    texts = [b"x" * n + b" word, and more" for n in (3, 70, 1, 40, 12, 90, 5, 33, 2, 64, 20)]
    docs = [Document(t, "en" if i % 2 else "fr", "test", f"d{i}") for i, t in enumerate(texts)]
    shapes = []
    model.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))

    def run(buffer):
        shapes.clear()
        r = evaluate_documents(model, iter(docs), seq_len=32, batch_size=4, mode="sample", seed=0, device="cpu",
                               buffer=buffer)
        return r, sum(b * t for b, t in shapes)

    (in_order, padded_in_order), (by_length, padded_by_length) = run(1), run(64)
    assert padded_by_length < 0.85 * padded_in_order
    for result, want in ((by_length, in_order), (by_length["by_lang"]["fr"], in_order["by_lang"]["fr"])):
        assert result["bytes"] == want["bytes"] and result["documents"] == want["documents"]
        for key in ("bpb", "bpb_doc_mean", "bytes_per_chunk", "boundary_rate", "whitespace_boundary_fraction"):
            assert result[key] == pytest.approx(want[key], rel=1e-6 if key.startswith("bpb") else 1e-12), key


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


def test_each_window_of_a_document_draws_from_its_own_seed(monkeypatch):
    """The seeds of a document's windows are window_seed(seed, text, 0), (..., 1), ...: a long
    document's windows never repeat each other's draws."""
    from megatok.config import load_config
    from megatok.data.documents import Document
    from megatok.eval import bpb
    from megatok.model import build_model
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs/tiny.json", ["data.seq_len=16"], world_size=1)
    model = build_model(cfg)
    seen = []
    real = bpb.row_seeds
    monkeypatch.setattr(bpb, "row_seeds", lambda seeds: seen.extend(seeds) or real(seeds))
    text = b"abcdefghijklmno " * 4  # 64 bytes + SEP: windows of 16 targets
    bpb.evaluate_documents(model, iter([Document(text, None, None, "d")]), seq_len=16, batch_size=8, mode="sample",
                           seed=3, device="cpu")
    assert seen == [bpb.window_seed(3, text, i) for i in range(4)] and len(set(seen)) == 4


def test_evaluation_restores_the_callers_rng_and_seeds_each_batch_by_its_index():
    """Validation inside training must not move the training RNG; a batch's sampled boundaries come
    from (seed, batch index): the same index, the same draws; another index, others."""
    from megatok.config import load_config
    from megatok.eval.bpb import evaluate_batches
    from megatok.model import build_model
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "configs/tiny.json", ['boundary={"strategy": "uniform", "target_rate": 0.25}'],
                      world_size=1)
    model = build_model(cfg)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)
    before = torch.random.get_rng_state()

    def chunks(index):
        return evaluate_batches(model, [(index, tokens)], mode="sample", seed=0, device="cpu")["chunks"]

    first, again, other = chunks(0), chunks(0), chunks(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert first == again and first != other
