"""The BPE token model (model.kind "bpe"): causality, bits per byte against an independent count,
the token data pipeline, and config errors."""

from __future__ import annotations

import math
import pickle
import re

import numpy as np
import pytest
import torch

from megatok import bpe
from megatok.config import ConfigError, load_config
from megatok.data.encoding import BpeEncoding, encoding_for
from megatok.data.documents import Document
from megatok.data.stream import PackedByteStream, make_loader, pack_documents, resolve_shards
from megatok.eval.bpb import evaluate_documents
from megatok.generate import generate, generate_batch
from megatok.model import build_model
from tests.bpe.conftest import MULTILINGUAL
from tests.conftest import run_tool


def bpe_overrides(tokenizer_dir, vocab: int = 768) -> list[str]:
    return ["model.kind=bpe", f"model.tokenizer={tokenizer_dir}", f"model.vocab_size={vocab}",
            "model.bytes_per_token=3.0", "model.n_encoder_layers=0", "model.n_decoder_layers=0",
            "model.d_model=32", "model.n_heads=2", "model.n_main_layers=2", "data.seq_len=32"]


@pytest.fixture(scope="module")
def tok_dir(tokenizer, tmp_path_factory):
    """The session tokenizer written to a directory, as megatok-train-bpe leaves it."""
    sp, _ = tokenizer
    out = tmp_path_factory.mktemp("tok")
    (out / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    return out


@pytest.fixture(scope="module")
def model_and_cfg(tok_dir):
    cfg = load_config(None, bpe_overrides(tok_dir))
    torch.manual_seed(0)
    return build_model(cfg).eval(), cfg


def test_causal(model_and_cfg):
    model, cfg = model_and_cfg
    x = torch.randint(3, 600, (2, 24))
    base = model(x).logits
    y = x.clone()
    y[:, 15:] = torch.randint(3, 600, (2, 9))
    assert torch.equal(model(y).logits[:, :15], base[:, :15])
    emb = model.embed(x).detach().requires_grad_(True)
    h = model.main(emb, torch.arange(24))
    h[:, 10].sum().backward()
    assert emb.grad[:, 11:].abs().sum() == 0 and emb.grad[:, :11].abs().sum() > 0


def test_bpb_is_token_nll_over_utf8_bytes(model_and_cfg, tokenizer):
    """evaluate_documents' bpb for the token model = sum of -log p(token) over the text / its UTF-8 bytes,
    computed here by hand from the logits (the </s> separator is context, not a target)."""
    model, cfg = model_and_cfg
    sp, _ = tokenizer
    text = MULTILINGUAL.encode() + b"\xff raw \xc3"
    res = evaluate_documents(model, iter([Document(text, "xx", None, "t")]), seq_len=4096, batch_size=1,
                             mode="sample", seed=0, device="cpu", encoding=encoding_for(cfg))
    ids = torch.tensor([sp.eos_id()] + bpe.encode_bytes(sp, text))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None, :-1]).logits[0].double(), -1)
    nll = -logp[torch.arange(len(ids) - 1), ids[1:]].sum().item()
    assert res["bytes"] == len(text)
    assert res["bpb"] == pytest.approx(nll / len(text) / math.log(2), rel=1e-6)
    assert res["bytes_per_token"] == pytest.approx(len(text) / (len(ids) - 1))
    assert res["by_lang"]["xx"]["bpb"] == pytest.approx(res["bpb"])


def test_windows_cover_every_token_once(model_and_cfg):
    """Short windows: the byte count is still the document's, every token predicted once."""
    model, cfg = model_and_cfg
    enc = encoding_for(cfg)
    text = (MULTILINGUAL * 3).encode()
    res = evaluate_documents(model, iter([Document(text, None, None, "t")]), seq_len=16, batch_size=4,
                             mode="sample", seed=0, device="cpu", encoding=enc)
    assert res["bytes"] == len(text)
    assert res["bytes_per_token"] == pytest.approx(len(text) / (len(enc.doc_ids(text)) - 1))


def test_stream_of_tokens_decodes_to_the_documents(tok_dir, shards):
    """The packed token stream (through a worker process: the encoding is pickled) spells the shards' documents."""
    from megatok.data.stream import iter_shard_documents

    enc = BpeEncoding(str(tok_dir))
    assert pickle.loads(pickle.dumps(enc)).doc_ids(b"abc").tolist() == enc.doc_ids(b"abc").tolist()
    urls = resolve_shards(str(shards), "train")
    stream = PackedByteStream(urls[:1], seq_len=32, batch_size=4, encoding=enc)
    batches = iter(make_loader(stream, 1))
    ids = []
    for i in range(3):
        t = next(batches)["tokens"]
        assert t.shape == (4, 33) and int(t.max()) < 768
        rows = t.tolist()
        ids += [i for row in rows for i in row[:-1]]
    sp = enc._processor()
    docs = [d.text for d in iter_shard_documents(urls[:1])]
    spelled = bpe.decode_ids(sp, ids)
    assert ids[0] == enc.sep
    assert b"".join(docs).startswith(spelled)  # separators spell no bytes
    assert len(spelled) > 3 * 4 * 32  # more than one byte per token


def test_generated_tokens_have_the_log_probs_of_one_forward_pass(model_and_cfg):
    model, cfg = model_and_cfg
    enc = encoding_for(cfg)
    prompt = b"The "
    g = generate(model, prompt, seq_len=cfg.data.seq_len, max_bytes=20, seed=2, encoding=enc, stop_at_separator=False)
    assert len(g.text) >= 20 and g.text == b"".join(enc.pieces()[i] for i in g.ids)
    assert all(enc.byte_lengths[i] > 0 for i in g.ids)  # text pieces only: no padding or control ids
    x = torch.tensor([[*enc.doc_ids(prompt), *g.ids]])
    assert x.shape[1] <= cfg.data.seq_len  # one window
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0].float(), -1)
    n = len(enc.doc_ids(prompt))
    at = torch.arange(n - 1, n - 1 + len(g.ids))
    torch.testing.assert_close(logp[at, torch.tensor(g.ids)], torch.tensor(g.logprobs), rtol=0, atol=1e-4)
    # the cached generation (TokenLM.step) equals rerunning the window at every token
    plain = generate(model, prompt, seq_len=cfg.data.seq_len, max_bytes=20, seed=2, encoding=enc,
                     stop_at_separator=False, cache=False)
    assert plain.ids == g.ids
    torch.testing.assert_close(torch.tensor(plain.logprobs), torch.tensor(g.logprobs), rtol=0, atol=1e-4)


def test_the_token_cache_is_rebuilt_when_the_window_is_full(model_and_cfg):
    """Past seq_len the cached generation restarts its window from the last seq_len // 2 ids: every
    token's log-prob is the one a forward pass over exactly that window gives."""
    model, cfg = model_and_cfg
    enc, S = encoding_for(cfg), cfg.data.seq_len
    prompt = b"The "
    g = generate(model, prompt, seq_len=S, max_bytes=4 * S, temperature=0, encoding=enc, stop_at_separator=False)
    n = len(enc.doc_ids(prompt))
    ids = [*enc.doc_ids(prompt), *g.ids]
    assert len(g.ids) > 2 * S
    lo, restarts = 0, 0  # the window is ids[lo:end]; when it would pass S ids it restarts at the last S // 2
    for k, tok in enumerate(g.ids):
        end = n + k
        if end - lo > S:
            lo, restarts = end - S // 2, restarts + 1
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[lo:end]])).logits[0, -1].float(), -1)
        text = torch.zeros_like(logp, dtype=torch.bool)
        text[:len(enc.byte_lengths)] = torch.as_tensor(enc.byte_lengths) > 0
        assert tok == int(logp.masked_fill(~text, float("-inf")).argmax()), k  # greedy over text ids
        assert abs(float(logp[tok]) - g.logprobs[k]) < 1e-4, k
    assert restarts >= 3


def test_a_batch_of_prompts_gives_every_row_what_it_gets_alone(model_and_cfg):
    """Prompts of different lengths decoded together (sampled at a temperature, each with its own seed; one
    longer than the window, every row past it, one ended early by a stop string): each row's tokens and
    log-probabilities are the ones it gets alone; so with the static step (fixed shapes), and with it compiled."""
    model, cfg = model_and_cfg
    enc, S = encoding_for(cfg), cfg.data.seq_len
    prompts, seeds = [b"The ", b"def main(argv):\n    return " * 6, b"", "Все люди ".encode()], [4, 1, 9, 2]
    kw = dict(seq_len=S, max_bytes=3 * S, temperature=0.9, top_p=0.95, encoding=enc, stop_at_separator=False)
    first = generate(model, prompts[2], seed=seeds[2], **kw)
    stop = [first.text[40:43]]
    alone = [generate(model, p, seed=s, stop=stop, **kw) for p, s in zip(prompts, seeds)]
    assert alone[2].stop == stop[0] and max(len(a.ids) for a in alone) > S
    for how in ({}, {"static": True}, {"compile": True}):
        batch = generate_batch(model, prompts, seeds=seeds, stop=stop, **how, **kw)
        for a, b in zip(alone, batch):
            assert (b.ids, b.text, b.stopped, b.stop) == (a.ids, a.text, a.stopped, a.stop)
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)
    assert len({a.text for a in alone}) == len(alone)


def test_pack_documents_pads_with_the_pad_id(tok_dir):
    enc = BpeEncoding(str(tok_dir))
    rows = pack_documents([b"hello world", b"second"], 64, enc)
    assert rows.shape == (1, 65)
    n = len(enc.doc_ids(b"hello world")) + len(enc.doc_ids(b"second"))
    assert (rows[0, n:] == enc.pad).all() and (rows[0, :n] != enc.pad).all()


@pytest.mark.dist
def test_zero3_partitioned_build_equals_the_plain_build(tok_dir):
    """Under ZeRO-3 the trainer builds the token model partitioned over the ranks (deepspeed.zero.Init);
    gathered, its weights and byte-length table equal a plain build's."""
    r = run_tool("zero_init_check", "--config", "configs/tiny.json", "--set", *bpe_overrides(tok_dir))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^bpe_lm\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+identical$", r.stdout, re.M), r.stdout


def test_config_errors(tok_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model.kind 'bpe' needs model.tokenizer, model.vocab_size"):
        load_config(None, ["model.kind=bpe", "model.n_encoder_layers=0", "model.n_decoder_layers=0"])
    with pytest.raises(ConfigError, match="model.n_encoder_layers must be 0"):
        load_config(None, [o for o in bpe_overrides(tok_dir) if "encoder" not in o])
    with pytest.raises(ConfigError, match="model.tokenizer is only for model.kind 'bpe'"):
        load_config(None, [f"model.tokenizer={tok_dir}"])
    cfg = load_config(None, bpe_overrides(tok_dir, vocab=100))
    with pytest.raises(ConfigError, match=r"model.tokenizer: .* has 700 pieces, more than model.vocab_size=100"):
        encoding_for(cfg)
    cfg = load_config(None, bpe_overrides(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="model.tokenizer: .*no such tokenizer model"):
        encoding_for(cfg)
    assert np.asarray(encoding_for(load_config(None, bpe_overrides(tok_dir))).byte_lengths).sum() > 700


def test_token_row_stats_count_byte_tokens_only():
    """A control target (</s> between packed documents) and padding are not counted: nll and tokens
    over the tokens that spell bytes, targets their UTF-8 bytes, positions every non-pad target."""
    from megatok.model.token_lm import token_row_stats

    byte_lengths = torch.tensor([0, 0, 3, 1, 2])  # id 0 pad, 1 </s>, then pieces of 3, 1 and 2 bytes
    y = torch.tensor([[2, 1, 3, 4, 0]])
    ce = torch.tensor([[1.0, 10.0, 2.0, 3.0, 100.0]])
    s = {k: float(v.sum()) for k, v in token_row_stats(y, ce, byte_lengths, pad_id=0).items()}
    assert s == {"nll": 6.0, "targets": 6.0, "tokens": 3.0, "positions": 4.0}
