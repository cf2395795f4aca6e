"""The window > 1 policy's scan (megatok.boundaries._scan.draw_scan) takes exactly the decisions of the
per-position loop (draw_loop, the reference), in both modes, with forced starts and padding, whatever
the block length; and the policy draws through it."""

import pytest
import torch

from megatok.boundaries import build_strategy
from megatok.boundaries.base import forced_starts
from megatok.boundaries._scan import MAX_SCAN_WINDOW, draw, draw_loop, draw_scan


def case(seed: int, B: int, T: int, w: int):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, generator=g) * 2
    weights = torch.randn(B, T, w - 1, generator=g) * 3  # strong: a decision often flips the next ones
    noise = torch.rand(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T // 2:] = False  # a padded row
    forced = torch.rand(B, T, generator=g) < 0.08
    forced[:, 0] = True
    return base, weights, noise, mask, forced


@pytest.mark.parametrize("mode", ["sample", "threshold"])
@pytest.mark.parametrize("w", [2, 3, 5, 8])
@pytest.mark.parametrize("budget", [1 << 22, 50, 1])  # one block; blocks of a few positions; one position each
def test_the_scan_takes_the_loops_decisions(mode, w, budget):
    for seed in range(4):
        base, weights, noise, mask, forced = case(seed, 3, 97, w)
        want = draw_loop(base, weights, noise, mask, forced, 6.0, mode)
        got = draw_scan(base, weights, noise, mask, forced, 6.0, mode, budget=budget)
        assert torch.equal(got, want)
        assert want[:, 1:].any() and not want[:, 1:].all()  # decisions of both kinds
        assert not want[0, 97 // 2:].any()  # none on padding


def test_a_window_past_the_scan_limit_is_drawn_by_the_loop_and_the_scan_agrees():
    w = MAX_SCAN_WINDOW + 1
    base, weights, noise, mask, forced = case(0, 2, 40, w)
    want = draw_loop(base, weights, noise, mask, forced, 6.0, "sample")
    assert torch.equal(draw(base, weights, noise, mask, forced, 6.0, "sample"), want)
    assert torch.equal(draw_scan(base, weights, noise, mask, forced, 6.0, "sample", budget=1 << 18), want)
    with pytest.raises(ValueError, match="mode"):
        draw(base, weights, noise, mask, forced, 6.0, "top")


@pytest.mark.parametrize("mode", ["sample", "threshold"])
def test_the_policy_draws_what_the_loop_draws(mode):
    """The strategy's decisions are the reference loop's on its own heads and noise, forced starts (a
    SEP) and padding included."""
    torch.manual_seed(0)
    strat = build_strategy("policy", d_model=8, target_rate=0.3, options={"window": 4}).train(mode == "sample")
    strat.eval_mode = mode
    with torch.no_grad():
        strat.window_head.weight.normal_(std=3.0)
        strat.window_head.bias.copy_(torch.tensor([-2.0, 1.5, 0.5]))
        strat.head.weight.normal_(std=1.0)
    h = torch.randn(3, 64, 8)
    x = torch.randint(0, 256, (3, 64))
    x[:, 20] = 256  # SEP: a forced start
    mask = torch.ones(3, 64, dtype=torch.bool)
    mask[2, 50:] = False
    forced = forced_starts(x, mask, 256)
    torch.manual_seed(3)
    b = strat(h, x, mask, forced)
    torch.manual_seed(3)
    noise = torch.rand(3, 64)
    with torch.no_grad():
        want = draw_loop(strat.head(h).squeeze(-1).float(), strat.window_head(h).float(), noise, mask, forced,
                         strat.options.logit_cap, mode)
    assert torch.equal(b.starts, want)
