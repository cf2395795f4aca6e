"""Evaluation's sums (megatok.eval.bpb): a document's figures do not depend on its batch, its neighbours or
their order; windows are batched by length; every window draws from its own seed; the caller's RNG is left
as it was."""

import pytest
import torch


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
