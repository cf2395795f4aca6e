"""The score-function estimator against plain reference computations."""

import math

import pytest
import torch

from megatok import rl
from megatok.boundaries import build_strategy


def reference_returns(adv, gamma, resets=None):
    """G_t by a plain loop; ``resets`` [B, T]: the sum restarts at each True (G_t = A_t before one)."""
    B, T = adv.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if resets is not None and t + 1 < T and resets[b, t + 1]:
                running = 0.0
            running = float(adv[b, t]) + gamma * running
            out[b, t] = running
    return out


@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("T,block", [(1, 64), (7, 64), (128, 64), (300, 64), (1000, 64), (4096, 128)])
def test_discounted_returns_equal_a_reference_loop(gamma, T, block):
    torch.manual_seed(T)
    adv = torch.randn(3, T)
    lengths = [T, max(1, T // 2), max(1, T - 3)]  # padded batch: zeros beyond each length
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    adv = adv * mask
    got = rl.discounted_returns(adv, gamma, block=block)
    want = reference_returns(adv, gamma)
    scale = want.abs().max().item() + 1
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * scale)


def test_discounted_returns_do_not_overflow_on_long_sequences():
    adv = torch.ones(1, 20000)
    g = rl.discounted_returns(adv, 0.9)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g[0, 0], torch.tensor(10.0), rtol=1e-4, atol=0)  # 1 / (1 - 0.9)


def test_batch_baseline_has_zero_mean_per_position_over_real_entries():
    torch.manual_seed(0)
    r = torch.randn(5, 30)
    mask = torch.arange(30)[None, :] < torch.tensor([30, 12, 12, 5, 1])[:, None]
    a = rl.batch_baseline(r, mask)
    for t in range(30):  # by hand: the reward less the mean over the sequences real at t
        real = mask[:, t]
        torch.testing.assert_close(a[real, t], r[real, t] - r[real, t].mean(), rtol=0, atol=1e-6)
    per_pos = (a * mask).sum(0) / mask.sum(0)
    torch.testing.assert_close(per_pos, torch.zeros(30), rtol=0, atol=1e-6)
    assert (a[~mask] == 0).all()
    # a position with one real sequence has advantage 0 there
    assert a[0, 29] == pytest.approx(0.0, abs=1e-6)



DP_WORKER = """
import sys, torch, torch.distributed as dist
from megatok import rl
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
r = torch.randn(3, 7, generator=torch.Generator().manual_seed(rank))
mask = torch.ones(3, 7, dtype=torch.bool)
mask[2, 4:] = rank == 0  # rank 1's last row is padded from t = 4
torch.save({"r": r, "mask": mask, "adv": rl.batch_baseline(r, mask, across_ranks=True),
            "local": rl.batch_baseline(r, mask)}, out)
dist.destroy_process_group()
"""


def test_the_data_parallel_baseline_is_the_mean_over_every_ranks_rows(tmp_path):
    """baseline_scope "data_parallel": two gloo ranks, each with its own rows; each rank's advantage is
    its reward less the per-position mean over both ranks' real rows (one all-reduce)."""
    from tests.conftest import two_gloo_ranks

    parts = two_gloo_ranks(tmp_path, DP_WORKER)
    r = torch.cat([p["r"] for p in parts])
    mask = torch.cat([p["mask"] for p in parts])
    whole = rl.batch_baseline(r, mask)  # one process holding both ranks' rows
    torch.testing.assert_close(torch.cat([p["adv"] for p in parts]), whole, rtol=0, atol=1e-6)
    assert not torch.allclose(parts[0]["local"], parts[0]["adv"])  # not the micro-batch's own mean

def test_policy_loss_gradient_equals_the_reinforce_expression_by_hand():
    torch.manual_seed(0)
    B, T, D, lam, gamma, cap = 3, 6, 4, 0.01, 0.9, 6.0
    strat = build_strategy("policy", d_model=D, target_rate=0.2,
                           options={"gamma": gamma, "lambda_policy": lam, "lambda_rate": 0.0, "logit_cap": cap,
                                    "start_step": 0, "start_margin": None})  # its terms on from the start
    strat.train()
    with torch.no_grad():
        strat.head.weight.normal_()
    h = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4:] = False
    b = strat(h, None, mask)
    ce_full, ce_early = torch.rand(B, T) * mask, torch.rand(B, T) * mask
    losses = strat.loss(b, ce_full, ce_early, mask)
    losses["policy_loss"].backward()

    # by hand: dL/dw = -lam / N * sum_t G_t (b_t - p_t) dl_t/draw_t h_t over free decisions
    r = (ce_early - ce_full) * mask
    mean = r.sum(0) / mask.sum(0)
    adv = (r - mean) * mask
    G = reference_returns(adv, gamma).float()
    raw = (h @ strat.head.weight.detach()[0] + strat.head.bias.detach()[0])
    p = torch.sigmoid(cap * torch.tanh(raw / cap))
    dl_draw = 1 - torch.tanh(raw / cap) ** 2
    decisions = mask.clone()
    decisions[:, 0] = False
    coef = -lam / decisions.sum() * G * (b.starts.float() - p) * dl_draw * decisions
    want_w = (coef[..., None] * h).sum((0, 1))
    torch.testing.assert_close(strat.head.weight.grad[0], want_w, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(strat.head.bias.grad[0], coef.sum(), rtol=1e-4, atol=1e-7)


def test_rate_loss_pushes_logits_toward_the_target():
    logits = torch.full((2, 10), 2.0, requires_grad=True)  # p ~ 0.88, far above rho = 0.2
    mask = torch.ones(2, 10, dtype=torch.bool)
    rl.rate_loss(logits, torch.sigmoid(logits), mask, 0.2, 0.01).backward()
    assert (logits.grad > 0).all()  # gradient descent lowers them
    logits.grad = None
    low = torch.full((2, 10), -4.0, requires_grad=True)
    rl.rate_loss(low, torch.sigmoid(low), mask, 0.2, 0.01).backward()
    assert (low.grad < 0).all()


def test_rate_loss_per_sequence_holds_each_sequence_not_only_the_average():
    """Two sequences at p = 0.35 and 0.05: the batch mean is the target 0.2, so the batch term does
    nothing; the per-sequence term lowers the first sequence's logits and raises the second's."""
    logits = torch.stack([torch.full((10,), math.log(0.35 / 0.65)), torch.full((10,), math.log(0.05 / 0.95))])
    mask = torch.ones(2, 10, dtype=torch.bool)
    batch = logits.clone().requires_grad_(True)
    rl.rate_loss(batch, torch.sigmoid(batch), mask, 0.2, 0.01).backward()
    torch.testing.assert_close(batch.grad, torch.zeros_like(batch), atol=1e-9, rtol=0)
    seq = logits.clone().requires_grad_(True)
    rl.rate_loss(seq, torch.sigmoid(seq), mask, 0.2, 0.01, per_sequence=True).backward()
    assert (seq.grad[0] > 0).all() and (seq.grad[1] < 0).all()
    # by hand: weight / n_seq * (p_b - rho) / T for every position of sequence b
    torch.testing.assert_close(seq.grad[:, 0], torch.tensor([0.01 / 2 * 0.15 / 10, 0.01 / 2 * -0.15 / 10]))
    # an all-padding sequence adds nothing and does not dilute the others
    pad = torch.cat([seq.detach(), torch.zeros(1, 10)]).requires_grad_(True)
    pmask = torch.cat([mask, torch.zeros(1, 10, dtype=torch.bool)])
    rl.rate_loss(pad, torch.sigmoid(pad), pmask, 0.2, 0.01, per_sequence=True).backward()
    torch.testing.assert_close(pad.grad[:2], seq.grad)


def test_policy_starts_at_the_target_rate_and_forces_the_first_boundary():
    torch.manual_seed(0)
    strat = build_strategy("policy", d_model=8, target_rate=0.2,
                           options={"start_step": 0, "start_margin": None}).train()  # its terms on from the start
    h = torch.zeros(64, 200, 8)
    b = strat(h, None, torch.ones(64, 200, dtype=torch.bool))
    assert b.starts[:, 0].all()
    torch.testing.assert_close(b.probs.mean(), torch.tensor(0.2), rtol=1e-4, atol=0)
    assert abs(b.starts[:, 1:].float().mean().item() - 0.2) < 0.01


def test_fixed_stride_is_every_one_over_rho_bytes():
    strat = build_strategy("fixed", d_model=8, target_rate=0.25, options={})
    x = torch.zeros(2, 10, dtype=torch.long)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    b = strat(torch.zeros(2, 10, 8), x, mask)
    assert b.starts[0].nonzero().flatten().tolist() == [0, 4, 8]
    assert b.starts[1].nonzero().flatten().tolist() == [0, 4]


def test_baseline_with_an_all_padding_row_and_column():
    r = torch.randn(3, 8)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[2] = False  # an all-padding sequence
    mask[:, 7] = False  # a position no sequence reaches
    a = rl.batch_baseline(r, mask)
    assert torch.isfinite(a).all() and (a[2] == 0).all() and (a[:, 7] == 0).all()
    g = rl.discounted_returns(a, 0.99)
    assert (g[2] == 0).all()


def test_reward_is_detached_and_gradients_go_where_they_should():
    """The policy loss reaches the policy head and the encoder, never through the reward; the LM loss
    never reaches the policy head."""
    from megatok.config import load_config
    from megatok.model.unet import ByteUNet

    cfg = load_config(None, ["model.d_model=32", "model.n_heads=2", "train.micro_batch_size=2",
                             "boundary.start_step=0", "boundary.start_margin=null"], world_size=1)  # terms on at once
    torch.manual_seed(0)
    model = ByteUNet(cfg.model, cfg.boundary).train()
    x = torch.randint(0, 256, (4, 33))

    def grads(term):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = model(x[:, :-1], x[:, 1:])
        out.terms[term].backward()
        return {n: (p.grad is not None and p.grad.abs().sum().item() > 0) for n, p in model.named_parameters()}

    policy = grads("policy_loss")
    assert policy["boundary.head.weight"] and policy["encoder.layers.0.attn.qkv.weight"]
    assert not any(v for n, v in policy.items() if n.startswith(("main.", "decoder.", "head.", "early_head.")))
    lm = grads("lm_loss")
    assert not lm["boundary.head.weight"] and not lm["boundary.head.bias"]
    assert lm["main.layers.0.mlp.up.weight"] and lm["early_head.weight"]
