"""H-Net router: the cosine rule, the ratio loss against its formula, the straight-through gate and
the EMA over chunks (the model's generic ``smooth`` hook)."""

import math

import pytest
import torch

from megatok.boundaries import build_strategy
from megatok.boundaries.hnet import ratio_loss
from megatok.model.chunking import ema_over_chunks
from tests.boundaries.conftest import small_model


def test_router_is_the_cosine_rule_with_identity_projections_and_p1_forced():
    strat = build_strategy("hnet", d_model=2, target_rate=0.2, options={})
    # consecutive states: same direction (p = 0), orthogonal (p = 0.5), opposite (p = 1), 45 degrees
    h = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [0.0, -1.0], [1.0, -1.0]]])
    b = strat(h, None, torch.ones(1, 5, dtype=torch.bool))
    want = [1.0, 0.0, 0.5, 1.0, (1 - math.cos(math.pi / 4)) / 2]
    torch.testing.assert_close(b.probs[0], torch.tensor(want), rtol=0, atol=1e-6)
    assert b.starts[0].tolist() == [True, False, False, True, False]  # p > 0.5, t = 0 forced
    torch.testing.assert_close(strat.wq.weight, torch.eye(2))
    torch.testing.assert_close(strat.wk.weight, torch.eye(2))


def test_ratio_loss_equals_its_formula_on_hand_made_inputs():
    starts = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    probs = torch.tensor([[1.0, 0.2, 0.1, 0.8, 0.3, 0.0, 0.4, 0.9], [1.0, 0.6, 0.2, 0.1, 0.7, 0.5, 0.0, 0.0]])
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6:] = False  # two padded positions do not count
    rho = 0.25
    N = 1 / rho
    F = (3 + 2) / 14
    G = (1.0 + 0.2 + 0.1 + 0.8 + 0.3 + 0.0 + 0.4 + 0.9 + 1.0 + 0.6 + 0.2 + 0.1 + 0.7 + 0.5) / 14
    want = N / (N - 1) * ((N - 1) * F * G + (1 - F) * (1 - G))
    got = ratio_loss(starts, probs, mask, rho)
    assert got.item() == pytest.approx(want, rel=1e-6)
    # through the strategy, with its weight
    strat = build_strategy("hnet", d_model=2, target_rate=rho, options={"ratio_weight": 0.07})  # not the default
    rec = {"starts": starts, "probs": probs}
    from megatok.boundaries.base import Boundaries

    term = strat.loss(Boundaries(**rec), None, None, mask)["rate_loss"]
    assert term.item() == pytest.approx(0.07 * want, rel=1e-6)


@pytest.mark.parametrize("rho", [0.2, 0.25, 0.5])
def test_ratio_loss_is_minimised_at_f_equal_g_equal_one_over_n(rho):
    T = 1000
    mask = torch.ones(1, T, dtype=torch.bool)
    values = {}
    for k in range(1, T):  # F = G = k / T: k boundaries, p equal to the fraction everywhere
        starts = torch.zeros(1, T, dtype=torch.bool)
        starts[0, :k] = True
        probs = torch.full((1, T), k / T, dtype=torch.float64)
        values[k / T] = ratio_loss(starts, probs, mask, rho).item()
    best = min(values, key=values.get)
    assert best == pytest.approx(rho, abs=1.5 / T)
    assert values[best] == pytest.approx(1.0, abs=1e-6)  # the minimum value is exactly 1
    # and for a fixed F = 1/N the loss no longer depends on G (no push either way)
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, :round(rho * T)] = True
    a = ratio_loss(starts, torch.full((1, T), 0.1), mask, rho)
    b = ratio_loss(starts, torch.full((1, T), 0.9), mask, rho)
    assert a.item() == pytest.approx(b.item(), abs=1e-5)


def test_ratio_loss_pushes_p_down_when_too_many_boundaries():
    strat = build_strategy("hnet", d_model=4, target_rate=0.2, options={})
    probs = torch.full((1, 10), 0.7, requires_grad=True)
    from megatok.boundaries.base import Boundaries

    loss = strat.loss(Boundaries(starts=probs.detach() > 0.5, probs=probs), None, None,
                      torch.ones(1, 10, dtype=torch.bool))["rate_loss"]
    loss.backward()
    assert (probs.grad > 0).all()  # F = 1 > 1/N: gradient descent lowers every p


def test_gate_is_one_forward_with_the_gradient_of_the_confidence():
    torch.manual_seed(0)
    strat = build_strategy("hnet", d_model=8, target_rate=0.2, options={})
    h = torch.randn(2, 12, 8, requires_grad=True)
    b = strat(h, None, torch.ones(2, 12, dtype=torch.bool))
    assert torch.equal(b.gate.detach(), torch.ones(2, 12))
    w = torch.randn(2, 12)
    (b.gate * w).sum().backward()
    g1 = h.grad.clone()
    h.grad = None
    b2 = strat(h, None, torch.ones(2, 12, dtype=torch.bool))
    conf = torch.maximum(b2.probs, 1 - b2.probs)  # = p where b = 1, 1 - p where b = 0
    (conf * w).sum().backward()
    torch.testing.assert_close(g1, h.grad)
    assert torch.equal(b2.smooth, b2.probs)


def test_ema_over_chunks_equals_the_recurrence():
    torch.manual_seed(0)
    for K in (1, 2, 5, 33, 130):
        z = torch.randn(3, K, 4, dtype=torch.float64)
        p = torch.rand(3, K, dtype=torch.float64)
        p[:, 0] = 1.0
        p[1, K // 2] = 0.0  # a chunk that keeps only its predecessor
        want, prev = torch.zeros_like(z), torch.zeros(3, 4, dtype=torch.float64)
        for j in range(K):
            prev = p[:, j, None] * z[:, j] + (1 - p[:, j, None]) * prev
            want[:, j] = prev
        torch.testing.assert_close(ema_over_chunks(z, p), want, rtol=1e-12, atol=1e-12)


def test_the_router_learns_through_the_language_model_loss():
    """The LM loss alone reaches Wq and Wk (gate + smoothing), with no score-function term."""
    model = small_model("hnet")
    x = torch.randint(0, 256, (2, 40))
    out = model(x[:, :-1], x[:, 1:])
    out.terms["lm_loss"].backward()
    assert model.boundary.wq.weight.grad.abs().sum() > 0 and model.boundary.wk.weight.grad.abs().sum() > 0
    assert set(out.terms) == {"lm_loss", "rate_loss"}


def test_smoothing_off_leaves_plain_upsampling():
    """boundary.smoothing false: no ``smooth`` hook, so the model's output is the one it gives with
    the EMA taken out by hand (the same weights, the same boundaries and gate)."""
    from tests.model.test_causality import make_model

    on, off = make_model("hnet"), make_model("hnet")
    off.boundary.options = off.boundary.options.model_copy(update={"smoothing": False})
    x = torch.randint(0, 256, (2, 30))
    b = off.boundary(torch.randn(2, 30, 32), x, torch.ones(2, 30, dtype=torch.bool))
    assert b.smooth is None and b.gate is not None
    strategy = on.boundary.forward

    def without_smooth(h, x, mask, forced):
        b = strategy(h, x, mask, forced)
        b.smooth = None
        return b

    smoothed = on(x).logits
    on.boundary.forward = without_smooth
    plain = on(x).logits
    torch.testing.assert_close(off(x).logits, plain, rtol=0, atol=0)
    assert not torch.allclose(smoothed, plain, atol=1e-4)
