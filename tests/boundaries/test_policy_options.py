"""What each of the policy's estimator options does, through ``Strategy.loss``, against plain loops:
the reward (early-exit or not), the batch baseline (on, off, over the micro-batch or every rank),
gamma, the rate term's scope, the threshold rule; and that the estimator points the right way
(a bandit) and is unbiased without a baseline (Monte Carlo against the exact gradient)."""

import pytest
import torch

from megatok.boundaries import build_strategy
from megatok.boundaries.base import Boundaries
from tests.conftest import decisive as decisive_heads
from tests.conftest import two_gloo_ranks
from tests.test_rl import reference_returns

LAM = 0.01


def inputs(seed=0, B=4, T=12, D=6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 9:] = False
    mask[3, 4:] = False
    ce_full = torch.rand(B, T, generator=g) * mask
    ce_early = (ce_full + torch.randn(B, T, generator=g)).clamp(min=0) * mask
    return h, mask, ce_full, ce_early


#: The policy's terms on from the first step: the default holds them until step 50 and then until the latch
#: opens (tests/boundaries/test_policy_pace.py); the estimator's tests start at once.
AT_ONCE = {"start_step": 0, "start_margin": None}


def decisive(strat):
    """Heads whose logits vary with h, and a window head that weighs the previous decisions (the same
    draws for every strategy built here)."""
    return decisive_heads(strat, 1.0, torch.Generator().manual_seed(7))


def reference_policy_loss(b, ce_full, ce_early, mask, *, early_exit_reward, batch_baseline, gamma,
                          all_rows=None):
    """-LAM * mean over decisions of G_t log pi(b_t), every step a loop. ``all_rows``: (reward, mask)
    of every rank's rows, for a baseline taken over all of them."""
    B, T = mask.shape
    reward = (ce_early - ce_full if early_exit_reward else -ce_full) * mask
    pool_r, pool_m = all_rows if all_rows is not None else (reward, mask)
    adv = torch.zeros(B, T, dtype=torch.float64)
    for t in range(T):
        real = [i for i in range(pool_m.shape[0]) if pool_m[i, t]]
        mean = sum(float(pool_r[i, t]) for i in real) / max(1, len(real))
        for i in range(B):
            if mask[i, t]:
                adv[i, t] = float(reward[i, t]) - (mean if batch_baseline else 0.0)
    G = reference_returns(adv, gamma)
    total, n = 0.0, 0
    for i in range(B):
        for t in range(1, T):  # t = 0 is forced: no decision
            if mask[i, t]:
                total += G[i, t] * float(b.log_probs[i, t].detach())
                n += 1
    return -LAM * total / n


@pytest.mark.parametrize("early_exit_reward", [True, False])
@pytest.mark.parametrize("batch_baseline", [True, False])
@pytest.mark.parametrize("gamma", [0.0, 0.9, 1.0])
def test_policy_loss_follows_the_reward_baseline_and_gamma_options(early_exit_reward, batch_baseline, gamma):
    options = {"early_exit_reward": early_exit_reward, "batch_baseline": batch_baseline, "gamma": gamma,
               "lambda_policy": LAM, **AT_ONCE}
    strat = decisive(build_strategy("policy", d_model=6, target_rate=0.2, options=options)).train()
    h, mask, ce_full, ce_early = inputs()
    torch.manual_seed(1)
    b = strat(h, None, mask)
    got = strat.loss(b, ce_full, ce_early, mask)["policy_loss"].item()
    want = reference_policy_loss(b, ce_full, ce_early, mask, early_exit_reward=early_exit_reward,
                                 batch_baseline=batch_baseline, gamma=gamma)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
    other = reference_policy_loss(b, ce_full, ce_early, mask, early_exit_reward=not early_exit_reward,
                                  batch_baseline=batch_baseline, gamma=gamma)
    assert got != pytest.approx(other, rel=1e-3)  # the option changes the loss on these inputs


def test_the_rate_scope_sequence_holds_each_sequence_through_the_strategy():
    """rate_scope "sequence": lambda_rate x the mean over sequences of mean(l) x (mean(p) - rho), on
    sequences whose rates differ (with one sequence the two scopes agree)."""
    h, mask, ce_full, ce_early = inputs()
    h[0] += 1.0  # rows with different rates under the decisive head
    terms = {}
    for scope in ("batch", "sequence"):
        strat = decisive(build_strategy("policy", d_model=6, target_rate=0.2,
                                        options={**AT_ONCE, "rate_scope": scope, "lambda_rate": 0.03})).train()
        b = strat(h, None, mask)
        terms[scope] = strat.loss(b, ce_full, ce_early, mask)["rate_loss"].item()
    l, p = b.extra["logits"], b.probs
    rows = [(l[i][mask[i]].mean().item(), p[i][mask[i]].mean().item()) for i in range(4)]
    assert max(r[1] for r in rows) - min(r[1] for r in rows) > 0.1
    want_seq = 0.03 * sum(ml * (mp - 0.2) for ml, mp in rows) / 4
    want_batch = 0.03 * l[mask].mean().item() * (p[mask].mean().item() - 0.2)
    assert terms["sequence"] == pytest.approx(want_seq, rel=1e-5)
    assert terms["batch"] == pytest.approx(want_batch, rel=1e-5)
    assert terms["sequence"] != pytest.approx(terms["batch"], rel=1e-2)


@pytest.mark.parametrize("window", [1, 3])
def test_the_threshold_rule_starts_a_chunk_where_p_is_above_one_half(window):
    strat = decisive(build_strategy("policy", d_model=6, target_rate=0.2, options={"window": window})).eval()
    strat.eval_mode = "threshold"
    h, mask, _, _ = inputs()
    b = strat(h, None, mask)
    want = (b.probs > 0.5) & mask
    want[:, 0] = True
    assert torch.equal(b.starts, want)
    assert 0.2 < b.starts[mask].float().mean().item() < 0.8  # both decisions occur
    strat.eval_mode = "sample"
    torch.manual_seed(0)
    assert not torch.equal(strat(h, None, mask).starts, b.starts)  # sampling is another rule


def test_the_estimator_raises_p_where_a_boundary_is_rewarded_and_lowers_it_elsewhere():
    """A bandit: a boundary at an even position earns reward 1, at an odd one costs 1; positions are
    told apart by h. Training the head on the policy loss alone (gamma 0, no rate term) moves p up at
    even positions and down at odd ones."""
    torch.manual_seed(0)
    strat = build_strategy("policy", d_model=2, target_rate=0.2,
                           options={**AT_ONCE, "gamma": 0.0, "lambda_policy": 1.0, "lambda_rate": 0.0}).train()
    B, T = 32, 16
    even = (torch.arange(T) % 2 == 0).float()
    h = torch.stack([even, 1 - even], -1).expand(B, T, 2).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    opt = torch.optim.Adam(strat.parameters(), lr=0.1)
    for _ in range(60):
        b = strat(h, None, mask)
        gain = torch.where(even.bool(), 1.0, -1.0) * b.starts.float()  # reward = ce_early - ce_full
        loss = strat.loss(b, torch.zeros(B, T), gain, mask)["policy_loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = strat(h, None, mask).probs[0]
    assert (p[2::2] > 0.9).all() and (p[1::2] < 0.05).all()


DP_WORKER = """
import sys, torch, torch.distributed as dist
from megatok.boundaries import build_strategy
from tests.boundaries.test_policy_options import AT_ONCE, decisive, inputs
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
h, mask, ce_full, ce_early = inputs(seed=rank)
got = {}
for scope in ("data_parallel", "micro_batch"):
    options = {**AT_ONCE, "baseline_scope": scope, "gamma": 0.9, "lambda_policy": 0.01}
    strat = decisive(build_strategy("policy", d_model=6, target_rate=0.2, options=options)).train()
    torch.manual_seed(rank)
    b = strat(h, None, mask)
    got[scope] = strat.loss(b, ce_full, ce_early, mask)["policy_loss"].item()
torch.save({"got": got, "log_probs": b.log_probs.detach(), "starts": b.starts}, out)
dist.destroy_process_group()
"""


def test_the_data_parallel_baseline_scope_takes_the_mean_over_every_ranks_rows(tmp_path):
    """baseline_scope "data_parallel" through Strategy.loss on two gloo ranks: each rank's policy loss
    is the loop reference with the baseline over both ranks' rows; "micro_batch" uses its own rows."""
    parts = two_gloo_ranks(tmp_path, DP_WORKER)
    rows = [inputs(seed=rank) for rank in (0, 1)]
    rewards = torch.cat([(ce_early - ce_full) * mask for _, mask, ce_full, ce_early in rows])
    masks = torch.cat([mask for _, mask, _, _ in rows])
    opts = {"early_exit_reward": True, "batch_baseline": True, "gamma": 0.9}
    for rank, (part, (_, mask, ce_full, ce_early)) in enumerate(zip(parts, rows)):
        b = Boundaries(starts=part["starts"], log_probs=part["log_probs"])
        across = reference_policy_loss(b, ce_full, ce_early, mask, **opts, all_rows=(rewards, masks))
        local = reference_policy_loss(b, ce_full, ce_early, mask, **opts)
        got = part["got"]
        assert got["data_parallel"] == pytest.approx(across, rel=1e-5, abs=1e-9), rank
        assert got["micro_batch"] == pytest.approx(local, rel=1e-5, abs=1e-9), rank
        assert across != pytest.approx(local, rel=1e-3)
