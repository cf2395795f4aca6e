"""The policy's variance-reduction and schedule options (all off by default), each against a loop, and
the estimator unbiased where that is claimed (Monte Carlo against the exact gradient); the per-row
diagnostics (spaces before words, score-function signal-to-noise)."""

import math

import pytest
import torch

from megatok import rl
from megatok.boundaries import build_strategy
from megatok.config import load_config
from megatok.flops import flops_per_byte
from megatok.model import build_model
from megatok.stats import ratios, row_stats, space_before_word
from tests.boundaries.test_policy_options import AT_ONCE, decisive, inputs
from tests.test_rl import reference_returns


def policy(**options):
    return build_strategy("policy", d_model=6, target_rate=0.2, options={"lambda_policy": 1.0, **AT_ONCE, **options})


def test_leave_one_out_baseline_against_a_loop():
    r = torch.randn(5, 7)
    mask = torch.rand(5, 7) > 0.2
    got = rl.batch_baseline(r * mask, mask, leave_one_out=True)
    for i in range(5):
        for t in range(7):
            others = [float(r[j, t]) for j in range(5) if j != i and mask[j, t]]
            want = 0.0 if not mask[i, t] else float(r[i, t]) - (sum(others) / len(others) if others else float(r[i, t]))
            assert float(got[i, t]) == pytest.approx(want, abs=1e-6)


def test_group_baseline_uses_the_other_samples_of_the_same_sequence():
    k, r = 3, torch.randn(6, 5)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[4, 3:] = False
    got = rl.group_baseline(r * mask, mask, k)
    for i in range(6):
        group = range(i // k * k, i // k * k + k)
        for t in range(5):
            others = [float(r[j, t]) for j in group if j != i and mask[j, t]]
            want = float(r[i, t]) - (sum(others) / len(others) if others else 0.0) if mask[i, t] else 0.0
            assert float(got[i, t]) == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="groups of 4"):
        rl.group_baseline(r, mask, 4)


def monte_carlo_gradient(strat, B, T, draws=400, value=None):
    """Mean over draws of d(policy loss)/d(head weight t), for independent decisions with reward c_t b_t,
    turned into an estimate of d E[sum_t r_t] / d l_t; and the exact c_t p_t (1 - p_t)."""
    with torch.no_grad():
        strat.head.weight.copy_(torch.linspace(-1.5, 1.5, T)[None])
        strat.head.bias.zero_()
        if value is not None:
            strat.value_head.weight.copy_(value[None])
    h = torch.eye(T).expand(B, T, T).contiguous()  # position t reads weight t only; every row the same text
    mask = torch.ones(B, T, dtype=torch.bool)
    c = torch.linspace(1.0, 2.0, T)
    torch.manual_seed(0)
    total = torch.zeros(T)
    for _ in range(draws):
        strat.zero_grad()
        b = strat(h, None, mask)
        strat.loss(b, torch.zeros(B, T), c * b.starts.float(), mask)["policy_loss"].backward()
        total += strat.head.weight.grad[0]
    raw = torch.linspace(-1.5, 1.5, T)
    cap = strat.options.logit_cap
    p = torch.sigmoid(cap * torch.tanh(raw / cap))
    est = -total / draws * (B * (T - 1)) / B / (1 - torch.tanh(raw / cap) ** 2)
    return est, c * p * (1 - p)


@pytest.mark.parametrize("options, scale", [({"batch_baseline": False}, 1.0), ({"batch_baseline": True}, 7 / 8),
                                            ({"leave_one_out": True}, 1.0), ({"samples": 2}, 1.0),
                                            ({"samples": 4}, 1.0), ({"estimator": "disarm", "samples": 2}, 1.0),
                                            ({"value_baseline": True, "batch_baseline": False}, 1.0),
                                            ({"value_baseline": True, "leave_one_out": True}, 1.0)])
def test_each_baseline_leaves_the_gradient_unbiased_or_scales_it(options, scale):
    """Independent decisions with reward c_t b_t: d E[sum r] / d l_t = c_t p_t (1 - p_t). The mean of the
    estimator's gradient over many samples matches it with no baseline, leave-one-out, the other samples
    of the same sequence or a (non-zero) learned value; the published batch mean, which includes each
    row's own reward, scales it by (B - 1) / B (docs/method.md's baseline)."""
    B, T = 8, 10
    strat = build_strategy("policy", d_model=T, target_rate=0.3,
                           options={**AT_ONCE, "gamma": 0.0, "lambda_policy": 1.0, "lambda_rate": 0.0, **options}).train()
    value = torch.linspace(0.5, -0.5, T) if options.get("value_baseline") else None
    est, exact = monte_carlo_gradient(strat, B, T, value=value)
    # 400 x 8 draws: off by at most about 3% here; a missing or extra (B - 1) / B is 12.5% off
    torch.testing.assert_close(est[1:], scale * exact[1:], rtol=0.08, atol=0.0)
    assert est[0] == 0  # t = 0 is forced: no decision


def test_the_group_baseline_removes_what_the_text_alone_decides():
    """Rewards that depend on the text of a row (a row offset) but not on the decisions: with two
    samples per sequence the advantages, and so the policy loss, are exactly zero; the batch mean
    leaves the rows' offsets in."""
    h, mask, _, _ = inputs(B=4)
    mask[:] = True
    offset = torch.tensor([0.0, 0.0, 3.0, 3.0])[:, None].expand(4, 12)  # rows 0,1 and 2,3: one text each
    for samples, zero in ((2, True), (1, False)):
        strat = decisive(policy(samples=samples, gamma=0.9)).train()
        b = strat(h, None, mask)
        loss = strat.loss(b, torch.zeros(4, 12), offset.clone(), mask)["policy_loss"].item()
        assert (loss == 0.0) is zero


def test_normalized_advantage_and_value_baseline_against_a_loop():
    h, mask, ce_full, ce_early = inputs()
    strat = decisive(policy(gamma=0.9, value_baseline=True, normalize_advantage=True, lambda_value=0.5)).train()
    with torch.no_grad():
        strat.value_head.weight.normal_(generator=torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    b = strat(h, None, mask)
    terms = strat.loss(b, ce_full, ce_early, mask)
    adv = rl.batch_baseline((ce_early - ce_full) * mask, mask)
    G = reference_returns(adv.double(), 0.9)
    V = (h @ strat.value_head.weight[0] + strat.value_head.bias).detach().double()
    dec = mask.clone()
    dec[:, 0] = False
    vals = [(float(G[i, t]), float(V[i, t])) for i in range(4) for t in range(12) if dec[i, t]]
    assert terms["value_loss"].item() == pytest.approx(0.5 * sum((g - v) ** 2 for g, v in vals) / len(vals), rel=1e-5)
    a = [g - v for g, v in vals]
    sd = math.sqrt(sum(x * x for x in a) / len(a) - (sum(a) / len(a)) ** 2)
    lp = [float(b.log_probs.detach()[i, t]) for i in range(4) for t in range(12) if dec[i, t]]
    want = -sum(x / sd * l for x, l in zip(a, lp)) / len(a)
    assert terms["policy_loss"].item() == pytest.approx(want, rel=1e-5)


def test_the_value_head_reads_a_detached_state_and_gets_no_policy_gradient():
    h, mask, ce_full, ce_early = inputs()
    h.requires_grad_(True)
    strat = decisive(policy(value_baseline=True)).train()
    b = strat(h, None, mask)
    terms = strat.loss(b, ce_full, ce_early, mask)
    terms["value_loss"].backward(retain_graph=True)
    assert h.grad is None or not h.grad.any()  # the value loss never reaches the encoder
    assert strat.value_head.weight.grad.abs().sum() > 0
    strat.zero_grad()
    terms["policy_loss"].backward()
    assert strat.value_head.weight.grad is None or not strat.value_head.weight.grad.any()


def test_the_delayed_start_waits_for_the_margin_and_then_stays_on():
    h, mask, ce_full, _ = inputs()
    strat = decisive(policy(start_margin=0.5, start_ema=0.0)).train()  # each micro-batch alone
    assert {"started", "gap_ema"} <= set(strat.state_dict())  # a checkpoint saves the latch and its average
    b = strat(h, None, mask)
    noise = 0.05 * torch.randn(ce_full.shape, generator=torch.Generator().manual_seed(5))
    small = ce_full + 0.1 * math.log(2) + noise  # the early head trails by about 0.1 bits per byte
    large = ce_full + 1.0 * math.log(2) + noise
    assert strat.loss(b, ce_full, small * mask, mask)["policy_loss"].item() == 0
    assert not strat.started
    assert strat.loss(b, ce_full, large * mask, mask)["policy_loss"].item() == 0  # this batch only flips it
    assert strat.started
    on = strat.loss(b, ce_full, small * mask, mask)["policy_loss"].item()  # latched: on from now
    ref = decisive(policy()).train().loss(b, ce_full, small * mask, mask)["policy_loss"].item()
    assert on == pytest.approx(ref) and on != 0


def test_the_gamma_schedule_moves_from_gamma_start_to_gamma():
    strat = policy(gamma=0.99, gamma_start=0.5, gamma_steps=100).train()
    got = []
    for step in (0, 50, 100, 300):
        strat.step = step
        got.append(strat.gamma_now())
    assert got == pytest.approx([0.5, 0.745, 0.99, 0.99])
    h, mask, ce_full, ce_early = inputs()
    strat = decisive(policy(gamma=0.99, gamma_start=0.5, gamma_steps=100)).train()
    strat.step = 50
    b = strat(h, None, mask)
    got = strat.loss(b, ce_full, ce_early, mask)["policy_loss"].item()
    fixed = decisive(policy(gamma=0.745)).train().loss(b, ce_full, ce_early, mask)["policy_loss"].item()
    assert got == pytest.approx(fixed, rel=1e-6)
    strat.eval()
    assert strat.gamma_now() == 0.99  # evaluation reads the final discount


def test_space_before_word_and_its_row_statistics():
    text = b"a bc  de\tf1 (g)\n  hi"
    x = torch.tensor([list(text)])
    want = [i for i in range(1, len(text) - 1) if text[i] in b" \t\n" and chr(text[i + 1]).isalnum()]
    assert space_before_word(x)[0].nonzero().flatten().tolist() == want
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[0, [0, 1, 3, 5]] = True  # two of the spaces before a word (1, 5), one elsewhere (3)
    probs = torch.full(x.shape, 0.25)
    probs[0, want] = 0.75
    zero = torch.zeros(x.shape)
    s = {k: v.sum().item() for k, v in row_stats(x, x, starts, zero, zero, probs=probs).items()}
    r = ratios(s)
    assert r["sbw_boundary_fraction"] == pytest.approx(2 / len(want))
    assert r["p_sbw"] == pytest.approx(0.75) and r["p_other"] == pytest.approx(0.25)
    assert s["other_positions"] == len(text) - 1 - len(want)  # t >= 1


def test_the_score_snr_figures_against_a_loop():
    h, mask, ce_full, ce_early = inputs()
    x = torch.randint(97, 100, mask.shape)
    x[:, ::3] = 32  # spaces before words
    strat = decisive(policy(gamma=0.9)).train()
    b = strat(h, x, mask)
    strat.loss(b, ce_full, ce_early, mask)
    rows = b.extra["rows"]
    G = reference_returns(rl.batch_baseline((ce_early - ce_full) * mask, mask).double(), 0.9)
    sbw = space_before_word(x) & mask
    for cls, sel in (("sbw", sbw), ("other", ~sbw)):
        u = [float(G[i, t] * (float(b.starts[i, t]) - float(b.probs.detach()[i, t])))
             for i in range(4) for t in range(1, 12) if mask[i, t] and sel[i, t]]
        assert rows[f"{cls}_decisions"].sum().item() == len(u)
        s = {f"score_{c}": rows[f"score_{c}"].sum() for c in ("sbw", "other")}
        s.update({f"score2_{c}": rows[f"score2_{c}"].sum() for c in ("sbw", "other")})
        s.update({f"{c}_decisions": rows[f"{c}_decisions"].sum() for c in ("sbw", "other")})
        mean = sum(u) / len(u)
        want = mean / math.sqrt(sum(v * v for v in u) / len(u) - mean ** 2)
        assert ratios({"nll": 0, "targets": 1, **s})[f"snr_{cls}"] == pytest.approx(want, rel=1e-4)


def test_samples_per_sequence_through_the_model():
    """boundary.samples=2: the model trains on two boundary samples of every sequence (different
    chunkings of the same bytes), reports each sequence once, and counts the FLOPs of both (everything
    after the encoder and its early-exit head twice); in evaluation it runs each sequence once."""
    one = load_config("configs/tiny.json")
    two = load_config("configs/tiny.json", overrides=["boundary.samples=2"])
    torch.manual_seed(0)
    model = build_model(two).train()
    x = torch.randint(0, 256, (3, 65))
    torch.manual_seed(1)
    out = model(x[:, :-1], x[:, 1:])
    assert out.logits.shape[0] == 6 and out.boundaries.starts.shape[0] == 6
    assert not torch.equal(out.boundaries.starts[0], out.boundaries.starts[1])  # two samples of row 0
    assert torch.equal(out.boundaries.starts[0::2].sum(1).double() / 2 + out.boundaries.starts[1::2].sum(1).double() / 2,
                       out.rows["chunks"])
    assert out.stats["targets"].item() == 3 * 64  # each byte counted once
    model.eval()
    assert model(x[:, :-1], x[:, 1:]).logits.shape[0] == 3
    f1, f2 = flops_per_byte(one), flops_per_byte(two)
    assert f2["forward"] == f1["forward"]  # the model, and its inference cost, do not change
    enc = (f1["byte_matmul"] + f1["byte_attention"]) / 2  # tiny: one encoder and one decoder layer alike
    once = enc + f1["heads"] / 2  # the encoder and the early-exit head on it run once per sequence
    assert f2["training"] == pytest.approx(3 * (once + 2 * (f1["forward"] - once)))


def test_the_latch_reads_the_early_exit_gap_whatever_the_reward():
    """With early_exit_reward off the reward is -CE_full (always negative); the latch still starts the
    policy once the early-exit head trails the full model by the margin."""
    h, mask, ce_full, _ = inputs()
    strat = decisive(policy(start_margin=0.5, start_ema=0.0, early_exit_reward=False)).train()
    b = strat(h, None, mask)
    strat.loss(b, ce_full, (ce_full + math.log(2)) * mask, mask)
    assert strat.started


@pytest.mark.parametrize("options, message", [
    ({"gamma_start": 0.9}, "gamma_start needs gamma_steps"),
    ({"samples": 2, "leave_one_out": True}, "samples > 1"),
    ({"samples": 2, "batch_baseline": False}, "samples > 1"),
    ({"samples": 2, "baseline_scope": "data_parallel"}, "samples > 1"),
])
def test_options_that_would_do_nothing_are_refused(options, message):
    with pytest.raises(Exception, match=message):
        policy(**options)


def test_the_discount_cache_stays_bounded_under_a_gamma_schedule():
    strat = decisive(policy(gamma=0.99, gamma_start=0.5, gamma_steps=300)).train()
    h, mask, ce_full, ce_early = inputs()
    b = strat(h, None, mask)
    for step in range(40):
        strat.step = step
        strat.loss(b, ce_full, ce_early, mask)
    assert len(rl._DISCOUNT_CACHE) <= 8


def test_disarm_is_unbiased_for_the_discounted_returns_of_interacting_decisions():
    """rl.disarm_credit against the exact d E[G_t] / d logit_t, enumerated over all 2^T decisions, where each
    reward depends on several decisions (so G_t does too) and gamma is 0.9 (docs/method.md derives it); the
    score function on the same draws agrees too."""
    T, gamma, N = 5, 0.9, 100_000
    logits = torch.tensor([0.4, -1.2, 0.0, 1.5, -0.3], dtype=torch.float64)
    p = torch.sigmoid(logits)

    def returns(b):  # b [n, T] bool -> G [n, T]
        x = b.double()
        prev = torch.nn.functional.pad(x, (1, 0))[:, :T]
        prev2 = torch.nn.functional.pad(x, (2, 0))[:, :T]
        r = x * torch.arange(1, T + 1) - 1.5 * x * prev + 0.7 * prev2 - 0.4 * (1 - x) * prev
        return rl.discounted_returns(r, gamma).double()

    every = torch.tensor([[(i >> t) & 1 for t in range(T)] for i in range(2 ** T)], dtype=torch.bool)
    prob = torch.where(every, p, 1 - p).prod(1)
    exact = (prob[:, None] * returns(every) * (every.double() - p)).sum(0)

    gen = torch.Generator().manual_seed(0)
    u = torch.rand(N, T, generator=gen, dtype=torch.float64)
    b, anti = u < p, (1 - u) < p
    G = returns(torch.stack([b, anti], 1).flatten(0, 1))
    g = rl.disarm_credit(G, torch.stack([b, anti], 1).flatten(0, 1), logits.expand(N, T))
    err = g.std(0) / N ** 0.5
    assert ((g.mean(0) - exact).abs() < 4 * err + 1e-9).all(), (g.mean(0), exact)
    score = G[0::2] * (b.double() - p)  # the score function on the first sample of each pair, the same draws
    assert ((score.mean(0) - exact).abs() < 4 * score.std(0) / N ** 0.5).all()
