"""Gumbel-sigmoid boundaries: hardening is {0, 1} forward and the relaxed sample's gradient backward;
the binomial prior is -log Binomial(k; n, rho) / n and holds the rate."""

import math

import pytest
import torch

from megatok.boundaries import build_strategy
from megatok.boundaries.gumbel import binomial_prior_loss, harden, relaxed_bernoulli
from tests.boundaries.conftest import small_model


def test_hardening_is_zero_one_forward_and_the_relaxed_gradient_backward():
    torch.manual_seed(0)
    logits = torch.randn(4, 50, requires_grad=True)
    u = torch.rand(4, 50)
    noise = torch.log(u) - torch.log1p(-u)
    w = torch.randn(4, 50)

    y = relaxed_bernoulli(logits, 0.7, noise)
    hard = harden(y)
    assert set(hard.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(hard.detach(), (y.detach() > 0.5).float())
    (hard * w).sum().backward()
    got = logits.grad.clone()

    logits.grad = None
    (relaxed_bernoulli(logits, 0.7, noise) * w).sum().backward()
    torch.testing.assert_close(got, logits.grad, rtol=0, atol=0)  # exactly the relaxed sample's gradient
    # and that gradient is the relaxed sigmoid's: y (1 - y) / tau
    y = y.detach()
    torch.testing.assert_close(got, w * y * (1 - y) / 0.7)


def test_hard_sample_is_bernoulli_of_sigmoid_logit():
    """P(sigmoid((l + logistic noise) / tau) > 0.5) = sigmoid(l), whatever tau."""
    torch.manual_seed(0)
    l = torch.full((200_000,), math.log(0.2 / 0.8))
    for tau in (0.5, 1.0):
        rate = harden(relaxed_bernoulli(l, tau)).mean().item()
        assert rate == pytest.approx(0.2, abs=0.005)


def test_binomial_prior_matches_torch_distributions_and_is_lowest_near_rho():
    n, rho = 40, 0.2
    mask = torch.ones(1, n, dtype=torch.bool)
    losses = {}
    for k in range(n + 1):
        hard = torch.zeros(1, n)
        hard[0, :k] = 1
        got = binomial_prior_loss(hard, mask, rho)
        want = -torch.distributions.Binomial(n, torch.tensor(rho)).log_prob(torch.tensor(float(k))) / n
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
        losses[k] = got.item()
    assert min(losses, key=losses.get) == round(n * rho)
    # padded positions do not count; all-padding rows are left out of the mean
    hard = torch.tensor([[1.0, 0, 1, 1], [1.0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    want = -torch.distributions.Binomial(2, torch.tensor(rho)).log_prob(torch.tensor(1.0)) / 2
    assert binomial_prior_loss(hard, mask, rho).item() == pytest.approx(want.item(), rel=1e-5)


def test_prior_gradient_pushes_logits_toward_the_rate():
    strat = build_strategy("gumbel", d_model=4, target_rate=0.2, options={}).train()
    with torch.no_grad():
        strat.head.bias.fill_(3.0)  # p ~ 0.95: far too many boundaries
    torch.manual_seed(0)
    h = torch.zeros(8, 64, 4)
    mask = torch.ones(8, 64, dtype=torch.bool)
    b = strat(h, None, mask)
    strat.loss(b, None, None, mask)["rate_loss"].backward()
    assert strat.head.bias.grad.item() > 0  # descent lowers the bias
    # the term is boundary.prior_weight x the prior (a weight other than the default 1)
    weighted = build_strategy("gumbel", d_model=4, target_rate=0.2, options={"prior_weight": 0.4})
    term = weighted.loss(b, None, None, mask)["rate_loss"]
    assert term.item() == pytest.approx(0.4 * binomial_prior_loss(b.extra["hard"], mask, 0.2).item(), rel=1e-6)


def test_strategy_starts_at_the_target_rate_forces_b1_and_gates_with_value_one():
    torch.manual_seed(0)
    strat = build_strategy("gumbel", d_model=8, target_rate=0.2, options={"temperature": 1.0}).train()
    h = torch.zeros(64, 200, 8)
    mask = torch.ones(64, 200, dtype=torch.bool)
    mask[0, 150:] = False
    b = strat(h, None, mask)
    assert b.starts[:, 0].all() and not b.starts[0, 150:].any()
    assert abs(b.starts[1:, 1:].float().mean().item() - 0.2) < 0.01
    assert torch.equal(b.gate.detach(), torch.ones(64, 200))
    # threshold evaluation: noise-free, p = 0.2 < 0.5 -> no boundary but the first
    strat.eval()
    strat.eval_mode = "threshold"
    b = strat(h, None, mask)
    assert b.starts.sum().item() == 64


def test_gate_gradient_follows_the_decision_and_the_forced_first_decision_has_none():
    """The gate is straight-through max(y, 1 - y) of the relaxed sample: raising the logit raises it
    where a chunk starts and lowers it where none does; b_1 is forced, so neither the gate nor the
    prior's count gives its logit a gradient."""
    torch.manual_seed(0)
    strat = build_strategy("gumbel", d_model=8, target_rate=0.3, options={"temperature": 1.0}).train()
    h = torch.randn(4, 50, 8)
    b = strat(h, None, torch.ones(4, 50, dtype=torch.bool))
    logits = b.extra["logits"]
    logits.retain_grad()
    b.gate.sum().backward(retain_graph=True)
    g, starts = logits.grad, b.starts
    assert (g[:, 0] == 0).all()
    assert (g[:, 1:][starts[:, 1:]] > 0).all() and (g[:, 1:][~starts[:, 1:]] < 0).all()
    assert starts[:, 1:].any() and (~starts[:, 1:]).any()
    logits.grad = None
    strat.loss(b, None, None, torch.ones(4, 50, dtype=torch.bool))["rate_loss"].backward()
    assert (logits.grad[:, 0] == 0).all() and logits.grad[:, 1:].abs().sum() > 0


def test_the_lm_loss_reaches_the_boundary_head():
    model = small_model("gumbel")
    x = torch.randint(0, 256, (2, 40))
    out = model(x[:, :-1], x[:, 1:])
    out.terms["lm_loss"].backward()
    assert model.boundary.head.weight.grad.abs().sum() > 0
    assert set(out.terms) == {"lm_loss", "rate_loss"}
