"""The policy's pace and exploration options (the default: a quarter of the learning rate, a latch from step 50;
the rest off; the tests below start from step 0 with no latch unless they say): a delayed start, its own learning rate and
its warm-up (the engine's groups: tests/train/test_engine.py), the exploration floor (unbiased for the policy it draws
from), the entropy bonus relative to the target rate, and the per-class trace of the estimator's terms."""

import math

import pytest
import torch

from megatok import rl
from megatok.boundaries import build_strategy
from megatok.stats import ratios, space_before_word
from tests.boundaries.test_policy_options import decisive, inputs
from tests.test_rl import reference_returns


def policy(**options):
    """The policy from step 0 without the latch (start_step 0, start_margin None) unless ``options`` say."""
    return build_strategy("policy", d_model=6, target_rate=0.2,
                          options={"lambda_policy": 1.0, "start_step": 0, "start_margin": None, **options})


def test_the_learning_rate_factor_of_the_policys_own_parameters():
    assert policy(lr_scale=1.0, lr_hold=False).lr_factor(0) is None  # the published setting: the heads follow the model's schedule
    assert [policy().lr_factor(s) for s in (0, 500)] == [0.25, 0.25]  # a quarter, from step 0
    default = build_strategy("policy", d_model=6, target_rate=0.2, options={})
    assert [default.lr_factor(s) for s in (0, 49, 50, 500)] == [0, 0, 0.25, 0.25]  # the default: still until step 50
    assert default.options.start_margin == 0.01 and default.started.item() is False  # and then until the latch opens
    strat = policy(start_step=10, lr_warmup_steps=4, lr_scale=0.5)
    assert [strat.lr_factor(s) for s in (0, 9, 10, 11, 13, 100)] == [0, 0, 0.125, 0.25, 0.5, 0.5]


def test_before_start_step_neither_term_moves_anything_and_from_it_the_published_terms_are_back():
    h, mask, ce_full, ce_early = inputs()
    strat = decisive(policy(start_step=5, gamma=0.9)).train()
    h = h.clone().requires_grad_(True)
    strat.step = 4
    b = strat(h, None, mask)
    terms = strat.loss(b, ce_full, ce_early, mask)
    sum(terms.values()).backward()
    assert h.grad is None or not h.grad.any()  # no policy or rate gradient reaches the encoder
    assert not strat.head.weight.grad.any() and not strat.head.bias.grad.any()
    assert b.extra["rows"]["sbw_decisions"] is not None  # the statistics are still recorded
    strat.step = 5
    torch.manual_seed(3)
    b = strat(h, None, mask)
    got = {k: v.item() for k, v in strat.loss(b, ce_full, ce_early, mask).items()}
    ref = decisive(policy(gamma=0.9)).train()
    want = {k: v.item() for k, v in ref.loss(b, ce_full, ce_early, mask).items()}
    assert got == pytest.approx(want) and got["policy_loss"] != 0


def test_the_exploration_floor_draws_from_the_mixture_and_decays():
    strat = policy(explore=0.5, explore_steps=100).train()
    with torch.no_grad():
        strat.head.weight.zero_()
        strat.head.bias.fill_(-8.0)
    p = torch.sigmoid(torch.tensor(-8.0 / 6).tanh() * 6).item()  # the capped logit's: about 0.0055
    h, mask = torch.zeros(64, 200, 6), torch.ones(64, 200, dtype=torch.bool)
    torch.manual_seed(0)
    for step, eps in ((0, 0.5), (50, 0.25), (100, 0.0)):  # eps falls to 0 over explore_steps
        strat.step = step
        rate = strat(h, None, mask).starts[:, 1:].float().mean().item()
        assert rate == pytest.approx((1 - eps) * p + eps * 0.2, abs=0.006)
    strat.step = 0
    strat.eval()  # evaluation draws from p
    assert strat(h, None, mask).starts[:, 1:].float().mean().item() == pytest.approx(p, abs=0.003)


def test_the_exploration_floor_leaves_the_score_function_unbiased():
    """Independent decisions drawn from p' = (1 - eps) p + eps rho with reward c_t b_t: the expected return's
    gradient with respect to the logit is c_t (1 - eps) p_t (1 - p_t); the mean of the estimator over many
    draws matches it (no baseline), and the per-decision score the statistics record is its own term."""
    B, T, eps = 8, 10, 0.4
    strat = build_strategy("policy", d_model=T, target_rate=0.3,
                           options={"gamma": 0.0, "lambda_policy": 1.0, "lambda_rate": 0.0, "batch_baseline": False,
                                    "explore": eps, "start_step": 0, "start_margin": None}).train()
    with torch.no_grad():
        strat.head.weight.copy_(torch.linspace(-1.5, 1.5, T)[None])
        strat.head.bias.zero_()
    h = torch.eye(T).expand(B, T, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    c = torch.linspace(1.0, 2.0, T)
    torch.manual_seed(0)
    total, draws = torch.zeros(T), 600
    for _ in range(draws):
        strat.zero_grad()
        b = strat(h, None, mask)
        strat.loss(b, torch.zeros(B, T), c * b.starts.float(), mask)["policy_loss"].backward()
        total += strat.head.weight.grad[0]
    raw = torch.linspace(-1.5, 1.5, T)
    cap = strat.options.logit_cap
    p = torch.sigmoid(cap * torch.tanh(raw / cap))
    est = -total / draws * (B * (T - 1)) / B / (1 - torch.tanh(raw / cap) ** 2)
    torch.testing.assert_close(est[1:], (c * (1 - eps) * p * (1 - p))[1:], rtol=0.08, atol=0.0)
    # the statistics' score term is the one the gradient uses: G_t d log pi(b_t) / d logit_t
    x = torch.full((B, T), 97)
    x[:, 3] = 32
    b = strat(h, x, mask)
    logits = b.extra["logits"].detach().requires_grad_(True)
    pp = (1 - eps) * torch.sigmoid(logits) + eps * 0.3
    torch.where(b.starts, pp.log(), torch.log1p(-pp)).sum().backward()
    strat.loss(b, torch.zeros(B, T), c * b.starts.float(), mask)
    G = reference_returns((c * b.starts.float()).double(), 0.0).float()
    rows = b.extra["rows"]
    want = (G * logits.grad)[:, 3].sum()
    assert rows["score_sbw"].sum().item() == pytest.approx(want.item(), rel=1e-5)


def test_explore_is_refused_where_it_cannot_apply():
    for options in ({"explore": 0.2, "estimator": "disarm", "samples": 2}, {"explore": 0.2, "window": 2}):
        with pytest.raises(ValueError, match="explore draws independent decisions"):
            policy(**options)


def test_the_entropy_bonus_pulls_every_logit_towards_the_target_rate():
    h, mask, ce_full, ce_early = inputs()
    strat = decisive(policy(entropy=0.5, explore_steps=10, lambda_rate=0.0)).train()
    b = strat(h, None, mask)
    term = strat.loss(b, ce_full, ce_early, mask)["entropy_loss"]
    logits = b.extra["logits"]
    dec = mask.clone()
    dec[:, 0] = False
    p = torch.sigmoid(logits)
    kl = p * torch.log(p / 0.2) + (1 - p) * torch.log((1 - p) / 0.8)
    assert term.item() == pytest.approx(0.5 * kl[dec].mean().item(), rel=1e-5)
    g = torch.autograd.grad(term, logits)[0][dec]
    assert ((g > 0) == (logits[dec] > math.log(0.2 / 0.8))).all()  # descent moves each logit towards logit(rho)
    strat.step = 5
    half = strat.loss(b, ce_full, ce_early, mask)["entropy_loss"].item()
    assert half == pytest.approx(term.item() / 2, rel=1e-5)
    strat.step = 10
    assert "entropy_loss" not in strat.loss(b, ce_full, ce_early, mask)


def test_the_trace_of_returns_rewards_and_logits_per_class():
    h, mask, ce_full, ce_early = inputs()
    g = torch.Generator().manual_seed(2)
    x = torch.where(torch.rand(mask.shape, generator=g) < 0.3, 32, 97)  # spaces in different columns per row
    strat = decisive(policy(gamma=0.9)).train()
    b = strat(h, x, mask)
    strat.loss(b, ce_full, ce_early, mask)
    s = {k: v.sum() for k, v in b.extra["rows"].items()}
    r = ratios({"nll": 0, "targets": 1, **s})
    reward = (ce_early - ce_full) * mask
    G = reference_returns(rl.batch_baseline(reward, mask).double(), 0.9)
    sel = space_before_word(x) & mask
    sel[:, 0] = False
    assert 5 < sel.sum() < 30
    assert r["ret_sbw"] == pytest.approx(G[sel].mean().item(), rel=1e-5)
    assert r["reward_sbw"] == pytest.approx(reward[sel].mean().item(), rel=1e-5)
    assert r["logit_sbw"] == pytest.approx(b.extra["logits"][sel].mean().item(), rel=1e-5)
    u = (G.float() * (b.starts.float() - b.probs.detach()))[sel]
    assert r["u_sbw"] == pytest.approx(u.mean().item(), rel=1e-4)


def test_the_margin_latch_averages_the_gap_from_start_step_and_freezes_both_terms_until_it_opens():
    """start_margin with start_ema 0.5: the gap (CE_early - CE_full, bits per byte) enters a moving average
    only from start_step on; the latch opens once the average passes the margin (after the micro-batch that
    takes it there); until then the policy, rate and entropy terms give no gradient to anything."""
    h, mask, ce_full, _ = inputs()
    strat = decisive(policy(start_margin=0.3, start_ema=0.5, start_step=2, entropy=0.1)).train()
    h = h.clone().requires_grad_(True)
    b = strat(h, None, mask)
    gap = (ce_full + 0.4 * math.log(2)) * mask  # the early head 0.4 bits per byte behind
    strat.step = 1  # before start_step: the average does not move
    strat.loss(b, ce_full, gap, mask)
    assert strat.gap_ema.item() == 0 and not strat.started
    strat.step = 2
    for want in (0.2, 0.3):  # 0.5 * 0.4, then 0.5 * 0.2 + 0.5 * 0.4: not above the margin yet
        terms = strat.loss(b, ce_full, gap, mask)
        assert strat.gap_ema.item() == pytest.approx(want, rel=1e-4) and not strat.started
        sum(terms.values()).backward(retain_graph=True)
        assert (h.grad is None or not h.grad.any()) and not strat.head.weight.grad.any()
    strat.loss(b, ce_full, gap, mask)  # 0.35: opens after this batch
    assert strat.started
    terms = strat.loss(b, ce_full, gap, mask)
    assert all(terms[k].item() != 0 for k in ("policy_loss", "rate_loss", "entropy_loss"))
