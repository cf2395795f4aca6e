"""megatok.load on trained runs of both kinds: deterministic scoring equal to megatok-evaluate, segments,
log-likelihoods against a hand computation, generation with stop strings, lists of prompts and seeds."""

from __future__ import annotations

import json

import pytest
import torch

import megatok
from megatok.data.documents import Document
from megatok.eval.bpb import evaluate_documents
from megatok.generate import generate
from tests.conftest import PARALLEL, decisive, run_tool, stdlib_texts

TEXT = stdlib_texts(n_files=1)[0][:300]  # longer than TINY's 64-byte windows


def test_score_is_deterministic_and_is_megatok_evaluates_bpb(tiny_run, tmp_path):
    data = tmp_path / "doc.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n")
    for rule, seed in (("threshold", 0), ("sample", 3)):
        model = megatok.load(tiny_run, boundary=rule, seed=seed)
        rng = torch.random.get_rng_state()
        first, again = model.score(TEXT), model.score(TEXT.encode())
        assert torch.equal(rng, torch.random.get_rng_state())  # the caller's generator is left alone
        assert first == again and first.bytes == len(TEXT.encode()) == len(first.byte_logprobs)
        assert first.boundary_rule == ("threshold" if rule == "threshold" else "sample(seed=3)")
        assert sum(first.byte_logprobs) == pytest.approx(first.logprob, rel=1e-6)
        r = run_tool("evaluate", "--run", tiny_run, "--data", data, "--boundary", rule, "--seed", seed)
        assert r.returncode == 0, r.stderr[-2000:]
        assert first.bits_per_byte == json.loads(r.stdout)["bpb"]  # exactly: summed as the evaluator sums
        # scored in one batch with other texts (padded to the widest window), each text's figures are its
        # own up to float rounding (the same boundaries: each window draws from its own seed)
        many = model.score_many([TEXT, "x" * 100, TEXT[:50]])
        for got, text in zip(many, [TEXT, "x" * 100, TEXT[:50]]):
            assert got.logprob == pytest.approx(model.score(text).logprob, rel=1e-5)
            assert got.byte_logprobs == pytest.approx(model.score(text).byte_logprobs, abs=1e-4)
    assert megatok.load(tiny_run, boundary="sample", seed=4).score(TEXT) != first  # another seed, other chunks


def test_segments_join_to_the_text_and_are_the_chunks_generation_reads(tiny_run):
    model = megatok.load(tiny_run)
    decisive(model.module.boundary, std=2.0, generator=torch.Generator().manual_seed(0))  # p away from 0.2
    short = "The quick brown fox jumps over the lazy dog."
    chunks = model.segment(short)
    assert b"".join(chunks) == short.encode() and 3 < len(chunks) < len(short)
    # generation reads a prompt chunked as one forward pass over it would be (megatok.generate)
    g = generate(model.module, short.encode(), seq_len=model.seq_len, max_bytes=0, boundary_mode="threshold")
    # (the first byte always begins the first chunk here; generation may keep it in the separator's)
    assert g.prompt_starts[1:] == _starts(chunks)[1:]
    # a text longer than a window: every window starts a chunk (input k * seq_len is byte k * seq_len - 1)
    long = model.segment(TEXT)
    assert b"".join(long) == TEXT.encode()
    starts = _starts(long)
    assert all(starts[k * model.seq_len - 1] for k in range(1, len(starts) // model.seq_len + 1))
    assert model.segment("") == [] and model.segment("a") == [b"a"]


def _starts(chunks: list[bytes]) -> list[bool]:
    return [j == 0 for c in chunks for j in range(len(c))]


def test_generate_stop_strings_lists_of_prompts_and_seeds(tiny_run):
    model = megatok.load(tiny_run)
    rng = torch.random.get_rng_state()
    greedy = model.generate("def ", max_bytes=40, temperature=0)
    assert greedy.finish_reason == "length" and len(greedy.data) == 40 and greedy.stop is None
    stop = greedy.data[7:9]
    cut = model.generate("def ", max_bytes=40, temperature=0, stop=["\x00never", stop.decode("latin-1").encode("latin-1")])
    assert cut.finish_reason == "stop" and cut.stop == stop and cut.data == greedy.data[:greedy.data.find(stop)]
    assert cut.generation.text.startswith(cut.data + stop)  # what was sampled, uncut
    # nucleus sampling with a tiny top_p keeps the most likely byte only: greedy
    assert model.generate("def ", max_bytes=40, top_p=1e-9, seed=9).data == greedy.data
    one = model.generate("def ", max_bytes=30, temperature=1.0, seed=5)
    assert model.generate("def ", max_bytes=30, temperature=1.0, seed=5) == one
    assert model.generate("def ", max_bytes=30, temperature=1.0, seed=6).data != one.data
    batch = model.generate(["def ", "The "], max_bytes=30, temperature=1.0, seed=5)
    assert [c.data for c in batch] == [one.data, model.generate("The ", max_bytes=30, seed=6).data]
    assert [c.data for c in model.generate(["def ", "The "], max_bytes=30, seed=[6, 5])] == [
        model.generate("def ", max_bytes=30, seed=6).data, model.generate("The ", max_bytes=30, seed=5).data]
    assert torch.equal(rng, torch.random.get_rng_state())
    with pytest.raises(ValueError, match="top_p"):
        model.generate("x", top_p=0)


def test_an_empty_stop_string_is_ignored(tiny_run):
    model = megatok.load(tiny_run)
    one = model.generate("def ", max_bytes=40, seed=1)
    k = next(k for k in range(1, 38) if one.data.find(one.data[k:k + 2]) == k)  # a stop string found after 0
    cut = model.generate("def ", max_bytes=40, seed=1, stop=[one.data[k:k + 2]])
    assert cut.finish_reason == "stop" and cut.data == one.data[:k]
    # (b"" is in every text: taken as found at 0, it would cut a completion another stop string ends to nothing)
    for empty in ("", b""):
        assert model.generate("def ", max_bytes=40, seed=1, stop=[one.data[k:k + 2], empty]) == cut
        assert model.generate("def ", max_bytes=40, seed=1, stop=empty) == one


def test_a_completion_cut_by_max_bytes_inside_a_character_leaves_it_out_of_text(tiny_run, monkeypatch):
    model = megatok.load(tiny_run)
    want, forward = "привет".encode(), model.module.forward

    def writes_russian(x, *args, **kw):  # the next byte of `want` made certain
        out = forward(x, *args, **kw)
        out.logits[0, -1, want[min(x.shape[1] - 1 - len(b"Hi: "), len(want) - 1)]] = 1e4
        return out

    monkeypatch.setattr(model.module, "forward", writes_russian)
    c = model.generate("Hi: ", max_bytes=5, temperature=0, cache=False)  # "пр" and the first byte of "и"
    assert c.finish_reason == "length" and c.data == want[:5] and c.text == "пр"


def test_the_token_model_scores_segments_and_continues(bpe_run):
    model = megatok.load(bpe_run)
    text = " ".join(PARALLEL["en"] + PARALLEL["ru"])
    s = model.score(text)
    figures = evaluate_documents(model.module, iter([Document(text.encode(), None, None, "")]), seq_len=model.seq_len,
                                 batch_size=4, mode="sample", seed=0, device="cpu", encoding=model.encoding)
    assert s.bits_per_byte == figures["bpb"] and s.boundary_rule is None
    assert b"".join(s.tokens) == text.encode() == b"".join(model.segment(text))
    ends = [i for i, v in enumerate(s.byte_logprobs) if v != 0]  # each token's log p sits on its last byte
    assert ends == list(torch.tensor([len(t) for t in s.tokens]).cumsum(0) - 1)
    assert [s.byte_logprobs[i] for i in ends] == s.token_logprobs
    # log p(continuation | context): the two tokenized apart, read as one document, by hand
    context, continuation = "All human beings", " are born free"
    lp, _ = model.loglikelihood(context, continuation)
    ids = model.encoding.doc_ids(context.encode()).tolist()
    cont = model.encoding.doc_ids(continuation.encode())[1:].tolist()
    with torch.no_grad():
        logits = model.module(torch.tensor([ids + cont])).logits[0].log_softmax(-1)
    by_hand = sum(logits[len(ids) - 1 + j, t].item() for j, t in enumerate(cont))
    assert lp == pytest.approx(by_hand, abs=1e-4)
    c = model.generate("All human", max_bytes=20, temperature=0, stop=" ")
    assert " " not in c.text and c.finish_reason in ("stop", "length", "separator")


def test_a_long_contexts_continuation_is_read_in_windows_that_end_at_it(tiny_run, bpe_run):
    """log p(continuation | context) when the two fill more than a window: the continuation read with as
    much context as fits before it (the last seq_len + 1 ids), not in megatok-evaluate's windows (where a
    continuation starting a window would see nothing of the context but its last id)."""
    text = TEXT.encode()
    for run in (tiny_run, bpe_run):
        model = megatok.load(run)
        # by hand: one forward over the last seq_len + 1 ids of the document
        for context, continuation in ((text[:64], b" import os"), (text[:150], b" import os"), (text[:20], b"x = 1")):
            ids = model.encoding.doc_ids(context).tolist()
            cont = model.encoding.doc_ids(continuation)[1:].tolist()
            window = torch.tensor([(ids + cont)[-(model.seq_len + 1):]])
            with torch.no_grad():
                ce = model.module(window[:, :-1], window[:, 1:]).ce_full[0]
            lp, _ = model.loglikelihood(context, continuation)
            assert lp == pytest.approx(-ce[-len(cont):].sum().item(), abs=1e-4)
    # the byte model: two contexts ending with the same byte give different figures; a document that fits in
    # a window keeps megatok-evaluate's figures; a continuation longer than a window is read in groups of
    # seq_len targets aligned at its end, so it splits by the chain rule at seq_len bytes from its end
    model = megatok.load(tiny_run)
    assert model.loglikelihood(b"A" * 63 + b"x", b" import")[0] != model.loglikelihood(text[:63] + b"x", b" import")[0]
    assert model.loglikelihood(text[:30], text[30:40])[0] == pytest.approx(
        sum(model.score(text[:40]).byte_logprobs[30:]), abs=1e-5)
    context, continuation = text[:100], text[100:250]
    m = len(continuation) - model.seq_len
    whole = model.loglikelihood(context, continuation)[0]
    assert whole == pytest.approx(model.loglikelihood(context, continuation[:m])[0]
                                  + model.loglikelihood(context + continuation[:m], continuation[m:])[0], abs=1e-4)


def test_the_static_step_gives_the_default_completions_and_cuda_graph_asks_for_a_gpu(tiny_run, bpe_run, capsys):
    """generate(static=True), the step a CUDA graph captures (fixed shapes, no host sync, rows kept to the
    end), gives every prompt the completion of the default step: prompts of different lengths, one past
    the window, one ended early by a stop string, both model kinds. cuda_graph on a CPU model, and
    megatok-generate --cuda-graph without a CUDA device, are one-line errors."""
    from megatok.cli import generate as generate_cli

    prompts = ["def ", TEXT[:150], "", "The quick brown fox"]
    for run, rule in ((tiny_run, "sample"), (bpe_run, "threshold")):
        model = megatok.load(run, boundary=rule)
        kw = dict(max_bytes=70, temperature=0.9, seed=[3, 4, 5, 6])
        stop = [model.generate(prompts[0], max_bytes=70, temperature=0.9, seed=3).data[20:22]]  # ends row 0 early
        plain, static = model.generate(prompts, stop=stop, **kw), model.generate(prompts, stop=stop, static=True, **kw)
        assert plain[0].finish_reason == "stop" and max(len(c.data) for c in plain) >= 70  # past the windows (64 bytes, 32 tokens)
        for a, b in zip(plain, static):
            assert (b.data, b.finish_reason, b.generation.starts) == (a.data, a.finish_reason, a.generation.starts)
            assert b.generation.logprobs == pytest.approx(a.generation.logprobs, abs=1e-4)
    with pytest.raises(ValueError, match=r"^cuda_graph needs the model on a CUDA device \(it is on cpu\)"):
        model.generate("def ", cuda_graph=True)
    capsys.readouterr()
    assert generate_cli.main(["--run", str(tiny_run), "--cuda-graph"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --cuda-graph needs a CUDA device (--device cuda), not cpu\n"


def test_what_cannot_be_scored_or_generated_is_one_line_error(tiny_run):
    model = megatok.load(tiny_run)
    with pytest.raises(ValueError, match="^max_bytes must be >= 0, got -1$"):
        model.generate("def ", max_bytes=-1)
    with pytest.raises(ValueError, match="^score: the text is empty: there is no byte to score$"):
        model.score("")
    with pytest.raises(ValueError, match="^score: text 1 of 2 is empty: there is no byte to score$"):
        model.score_many(["a", b""])
    assert model.generate("def ", max_bytes=0).data == b"" and model.loglikelihood("def", "") == (0.0, True)


def test_load_names_what_it_cannot_use(tiny_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a megatok run directory"):
        megatok.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint step00000999|not found"):
        megatok.load(tiny_run, checkpoint="step00000999")
    with pytest.raises(ValueError, match="dtype must be one of"):
        megatok.load(tiny_run, dtype="int8")
    with pytest.raises(ValueError, match="boundary must be one of"):
        megatok.load(tiny_run, boundary="argmax")
    tag = sorted(p.name for p in (tiny_run / "checkpoints").glob("step*"))[-1]
    bf16 = megatok.load(tiny_run, checkpoint=tag, dtype="bf16")
    assert bf16.checkpoint == tag and {p.dtype for p in bf16.module.parameters()} == {torch.bfloat16}
    assert "megatok.Model(" in repr(bf16) and "kind=unet" in repr(bf16)
