"""model.document_mask: the documents packed into one window are independent. Every output inside a
document (logits, early-exit logits, boundaries) is the same whatever precedes its SEP, for every
strategy (uniform draws its count per window: tested for its forced starts only), for the BPE token
model too; causality still holds; and the policy neither credits a document's decisions with the next
one's rewards nor lets a window of past decisions reach across a SEP."""

import pytest
import torch

from megatok import rl
from megatok.boundaries import build_strategy
from megatok.config import ModelConfig
from megatok.model.token_lm import TokenLM
from megatok.vocab import SEP
from tests.boundaries.test_policy_options import AT_ONCE
from tests.conftest import decisive
from tests.model.test_causality import STRATEGIES, make_model
from tests.test_rl import reference_returns

B_TEXT = b"def singing(s):\n    return s.strings + 'ring'  # naive caf\xc3\xa9 and so on"
A_TEXTS = [b"In the beginning there were bytes; then tokens", b"x = 1  # short", b"the self.thing = other  # words, more"]


def window(a: bytes, b: bytes) -> torch.Tensor:
    return torch.tensor([[SEP, *a, SEP, *b]])


def document_model(strategy, document_mask=True):
    # heads that actually decide (p near 0.5, a window that matters): make_model sets the policy's
    model = make_model(strategy, heads_std=1.0, document_mask=str(document_mask).lower())
    model.boundary.eval_mode = "threshold"  # deterministic decisions
    if strategy.startswith("gumbel"):
        decisive(model.boundary, 1.0)
    return model


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "uniform"])
def test_a_document_sees_nothing_before_its_sep(strategy):
    model = document_model(strategy)
    outs = []
    with torch.no_grad():
        for a in A_TEXTS:
            out = model(window(a, B_TEXT))
            n = len(B_TEXT) + 1  # B's SEP and its bytes
            outs.append((out.logits[0, -n:], out.early_logits[0, -n:], out.boundaries.starts[0, -n:]))
    for logits, early, starts in outs[1:]:
        assert torch.equal(starts, outs[0][2])
        torch.testing.assert_close(logits, outs[0][0], rtol=0, atol=1e-4)
        torch.testing.assert_close(early, outs[0][1], rtol=0, atol=1e-4)
    assert outs[0][2][0]  # a chunk starts at the SEP
    assert outs[0][2].sum() > 2  # and the document has chunks of its own


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "uniform"])
def test_without_the_mask_documents_do_see_each_other(strategy):
    """The test above can fail: the same model without document_mask reads across the SEP."""
    model = document_model(strategy, document_mask=False)
    with torch.no_grad():
        a, b = (model(window(t, B_TEXT)).logits[0, -len(B_TEXT):] for t in A_TEXTS[:2])
    assert not torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_sep_starts_a_chunk_and_causality_holds(strategy):
    model = make_model(strategy, document_mask="true")
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 48))
    x[:, [0, 9, 30]] = SEP
    t = 20
    with torch.no_grad():
        base = model(x)
        assert base.boundaries.starts[:, [0, 9, 30]].all()
        x2 = x.clone()
        x2[:, t + 1:] = torch.randint(0, 256, x2[:, t + 1:].shape)
        x2[:, t + 3] = SEP  # a new document in the future changes nothing before it
        out = model(x2, starts=base.boundaries.starts)
    torch.testing.assert_close(out.logits[:, :t + 1], base.logits[:, :t + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_stops_at_the_sep(strategy):
    """In training mode (sampled boundaries, straight-through gates), the outputs inside a document
    have zero gradient with respect to the bytes of the one before."""
    model = make_model(strategy, document_mask="true").train()
    x = torch.randint(0, 256, (2, 40))
    x[:, 15] = SEP
    kept = {}

    def keep(module, inputs, output):
        output.retain_grad()
        kept["emb"] = output

    model.embed.register_forward_hook(keep)
    out = model(x)
    (out.logits[:, 15:].square().sum() + out.early_logits[:, 15:].square().sum()).backward()
    assert kept["emb"].grad[:, :15].abs().max().item() == 0.0
    assert kept["emb"].grad[:, 15:].abs().max().item() > 0.0


def test_token_model_documents_are_independent():
    cfg = ModelConfig(kind="bpe", tokenizer="unused", vocab_size=64, bytes_per_token=3.0, d_model=32, n_heads=2,
                      n_encoder_layers=0, n_decoder_layers=0, document_mask=True)
    torch.manual_seed(0)
    model = TokenLM(cfg, pad_id=0, sep_id=2).eval()
    doc_b = torch.randint(3, 64, (20,))
    rows = [torch.cat([torch.tensor([2]), torch.randint(3, 64, (n,)), torch.tensor([2]), doc_b]) for n in (5, 11)]
    with torch.no_grad():
        a, b = (model(r[None]).logits[0, -21:] for r in rows)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    model.cfg = cfg.model_copy(update={"document_mask": False})
    with torch.no_grad():
        a, b = (model(r[None]).logits[0, -21:] for r in rows)
    assert not torch.allclose(a, b, atol=1e-4)
    with pytest.raises(ValueError, match="sep_id"):
        TokenLM(cfg)(rows[0][None])


@pytest.mark.parametrize("gamma", [0.0, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("T,block", [(300, 128), (37, 8), (64, 4)])
def test_returns_stop_at_resets(gamma, T, block):
    torch.manual_seed(0)
    a = torch.randn(3, T, dtype=torch.float64)
    resets = torch.rand(3, T) < 0.05
    resets[:, 0] = True
    resets[1, ::block] = True  # resets on block edges
    got = rl.discounted_returns(a.float(), gamma, block=block, resets=resets)
    torch.testing.assert_close(got.double(), reference_returns(a, gamma, resets), rtol=1e-4, atol=1e-4)


def test_forced_starts_are_no_decisions_and_windows_forget_before_them():
    torch.manual_seed(0)
    strat = build_strategy("policy", d_model=8, target_rate=0.3,
                           options={**AT_ONCE, "window": 4, "lambda_rate": 0.0}).train()
    with torch.no_grad():
        strat.window_head.weight.normal_(std=3.0)
        strat.window_head.bias.fill_(2.0)
    forced = torch.zeros(6, 30, dtype=torch.bool)
    forced[:, [0, 12]] = True
    mask = torch.ones(6, 30, dtype=torch.bool)
    h = torch.randn(6, 30, 8)
    torch.manual_seed(1)
    base = strat(h, None, mask, forced)
    for seed in range(5):  # other histories before position 12 change nothing from 12 on
        h2 = h.clone()
        h2[:, :12] = torch.randn(6, 12, 8, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(1)
        b = strat(h2, None, mask, forced)
        assert torch.equal(b.starts[:, 12:], base.starts[:, 12:])
        torch.testing.assert_close(b.log_probs[:, 12:], base.log_probs[:, 12:])
    # no policy gradient reaches the forced decision at 12, and the decisions before it are not
    # credited with the rewards after it
    ce_full, ce_early = torch.rand(6, 30), torch.rand(6, 30) + 0.5
    grads = []
    for later in (0.0, 5.0):
        hg = h.clone().requires_grad_()
        torch.manual_seed(2)
        b = strat(hg, None, mask, forced)
        ce = ce_full.clone()
        ce[:, 12:] += later * torch.rand(6, 18, generator=torch.Generator().manual_seed(3))
        strat.loss(b, ce, ce_early, mask)["policy_loss"].backward()
        grads.append(hg.grad)
    assert grads[0][:, 12].abs().max().item() == 0.0
    assert grads[0][:, 13].abs().max().item() > 0.0
    torch.testing.assert_close(grads[1][:, :12], grads[0][:, :12])
    assert not torch.allclose(grads[1][:, 13:], grads[0][:, 13:])


def test_one_document_is_plain_causal_attention():
    from megatok.model.blocks import attention, document_mask

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 10, 8).unbind(0)
    one = document_mask(torch.ones(2, 10, dtype=torch.long))[:, None]
    torch.testing.assert_close(attention(q, k, v, mask=one), attention(q, k, v, backend="sdpa"))
    two = document_mask(torch.tensor([[1] * 4 + [2] * 6] * 2))[:, None]
    alone = attention(q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], backend="sdpa")
    torch.testing.assert_close(attention(q, k, v, mask=two)[..., 4:, :], alone)


def test_uniform_adds_the_forced_starts_to_its_draw():
    from megatok.boundaries.uniform import uniform_starts

    mask = torch.ones(4, 100, dtype=torch.bool)
    forced = torch.zeros_like(mask)
    forced[:, [0, 30, 31, 70]] = True
    drawn = uniform_starts(mask, 0.2, torch.Generator().manual_seed(0))
    s = uniform_starts(mask, 0.2, torch.Generator().manual_seed(0), forced=forced)
    assert torch.equal(s, drawn | forced)  # the SEPs take nothing from the draw (which cannot see them)


def test_a_stack_keeps_one_mask_for_all_its_layers():
    """The mask is built once per stack in the activations' dtype, so autograd keeps one [B, 1, T, T]
    tensor for the backward, not one per layer (what megatok.sizing counts)."""
    from megatok.model.blocks import Stack

    stack = Stack(3, 16, 2, 32, eps=1e-5, theta=10000.0)
    x = torch.randn(2, 12, 16, requires_grad=True)
    docs = torch.tensor([[1] * 5 + [2] * 7] * 2)
    saved = []

    def pack(t):
        if t.shape == (2, 1, 12, 12):
            saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stack(x, torch.arange(12), docs).sum().backward()
    assert len(saved) == 3 and len(set(saved)) == 1
