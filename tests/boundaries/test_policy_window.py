"""The score-function policy's window option: decisions conditioned on the previous w - 1 decisions."""

import torch
import torch.nn.functional as F

from megatok.boundaries import build_strategy
from tests.boundaries.test_policy_options import AT_ONCE


def test_window_one_is_the_independent_policy_and_larger_windows_start_equal():
    torch.manual_seed(0)
    h = torch.randn(4, 60, 8)
    mask = torch.ones(4, 60, dtype=torch.bool)
    mask[3, 40:] = False
    torch.manual_seed(1)
    one = build_strategy("policy", d_model=8, target_rate=0.2, options={}).train()
    torch.manual_seed(1)
    three = build_strategy("policy", d_model=8, target_rate=0.2, options={"window": 3}).train()
    assert one.window_head is None and three.window_head.weight.shape == (2, 8)
    torch.manual_seed(2)
    a = one(h, None, mask)
    torch.manual_seed(2)
    b = three(h, None, mask)  # the window head starts at zero: the same decisions from the same noise
    assert torch.equal(a.starts, b.starts)
    torch.testing.assert_close(a.log_probs, b.log_probs)


def test_window_decisions_follow_the_sequential_rule_and_log_probs_match():
    torch.manual_seed(0)
    strat = build_strategy("policy", d_model=6, target_rate=0.3, options={**AT_ONCE, "window": 3, "logit_cap": 6.0}).train()
    with torch.no_grad():
        strat.window_head.weight.normal_(std=2.0)
        strat.window_head.bias.copy_(torch.tensor([-3.0, 2.0]))
    h = torch.randn(3, 50, 6)
    mask = torch.ones(3, 50, dtype=torch.bool)
    torch.manual_seed(5)
    b = strat(h, None, mask)
    # reference: a plain loop with the same noise
    torch.manual_seed(5)
    noise = torch.rand(3, 50)
    base = strat.head(h).squeeze(-1).detach()
    wts = strat.window_head(h).detach()
    want = torch.zeros(3, 50, dtype=torch.bool)
    want_lp = torch.zeros(3, 50)
    for i in range(3):
        for t in range(50):
            prev = torch.tensor([float(want[i, t - k]) if t - k >= 0 else 0.0 for k in (1, 2)])
            l = 6.0 * torch.tanh((base[i, t] + (wts[i, t] * prev).sum()) / 6.0)
            want[i, t] = True if t == 0 else bool(noise[i, t] < torch.sigmoid(l))
            want_lp[i, t] = F.logsigmoid(l) if want[i, t] else F.logsigmoid(-l)
    assert torch.equal(b.starts, want)
    torch.testing.assert_close(b.log_probs.detach(), want_lp, rtol=1e-5, atol=1e-5)
    # the previous decision matters: with these weights a boundary right after one is rare
    after = b.starts[:, 1:][b.starts[:, :-1]].float().mean()
    assert after < b.starts[:, 1:].float().mean()


def test_window_gradients_reach_both_heads():
    torch.manual_seed(0)
    strat = build_strategy("policy", d_model=6, target_rate=0.3, options={**AT_ONCE, "window": 2}).train()
    h = torch.randn(4, 30, 6)
    mask = torch.ones(4, 30, dtype=torch.bool)
    b = strat(h, None, mask)
    loss = strat.loss(b, torch.rand(4, 30), torch.rand(4, 30) + 0.5, mask)
    (loss["policy_loss"] + loss["rate_loss"]).backward()
    assert strat.head.weight.grad.abs().sum() > 0 and strat.window_head.bias.grad.abs().sum() > 0
