"""The score-function estimator's pieces: advantages, discounted returns, policy and rate losses.

All functions take per-byte tensors [B, T] and a bool mask [B, T] that is True at positions that
carry a real prediction target. Padding is at the end of a sequence (right padding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def batch_baseline(r: torch.Tensor, mask: torch.Tensor, across_ranks: bool = False,
                   leave_one_out: bool = False) -> torch.Tensor:
    """A_t = r_t - mean over the batch of r_t, the mean taken over sequences that are real at t.

    Padded positions get 0 and do not enter the mean. ``across_ranks``: the batch is every rank's
    micro-batch (one all-reduce of the per-position sums and counts over the default process group,
    when one is up; every rank must call it, with the same T). ``leave_one_out``: the mean over the
    other sequences only, so a sequence's baseline never contains its own reward (0 where it is the
    only real one).
    """
    m = mask.to(r.dtype)
    sums = torch.stack([(r * m).sum(0), m.sum(0)])
    if across_ranks and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    if leave_one_out:
        others = sums[1] - m
        mean = torch.where(others > 0, (sums[0] - r * m) / others.clamp(min=1), r)
        return (r - mean) * m
    mean = sums[0] / sums[1].clamp(min=1)
    return (r - mean) * m


def group_baseline(r: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """A_t = r_t - the mean of r_t over the other k - 1 rows of its group (rows i*k .. i*k + k - 1 are
    samples of the same sequence): the baseline shares the row's text, so what the text alone makes
    easy or hard cancels, and it is independent of the row's own decisions (unbiased). 0 at padding."""
    B, T = r.shape
    if B % k:
        raise ValueError(f"a batch of {B} rows is not made of groups of {k} samples")
    m = mask.to(r.dtype)
    g_sum, g_n = (r * m).view(-1, k, T).sum(1, keepdim=True), m.view(-1, k, T).sum(1, keepdim=True)
    others = (g_n - m.view(-1, k, T)).clamp(min=1)
    mean = ((g_sum - (r * m).view(-1, k, T)) / others).view(B, T)
    return (r - mean) * m


def normalize(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x divided by its standard deviation over ``mask`` (not centred: the baseline did that)."""
    m = mask.to(x.dtype)
    var = masked_mean(x * x, mask) - masked_mean(x, mask) ** 2
    return x * m / var.clamp(min=1e-8).sqrt()


_DISCOUNT_CACHE: dict = {}


def _discount_matrix(gamma: float | torch.Tensor, n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gamma^(k - t) for k >= t within a block [n, n], gamma^(n - t) [n]), cached per (gamma, n, device, dtype);
    computed afresh inside compiled code, whose graph then holds them (a cache filled while tracing would
    make the next call recompile), and for a tensor gamma (a schedule's, while compiling)."""
    if torch.compiler.is_compiling() or torch.is_tensor(gamma):
        return _discount_tables(gamma, n, device, dtype)
    key = (float(gamma), n, device, dtype)
    if key not in _DISCOUNT_CACHE:
        if len(_DISCOUNT_CACHE) >= 8:  # bounded: a gamma schedule brings a new gamma every step
            _DISCOUNT_CACHE.clear()
        _DISCOUNT_CACHE[key] = _discount_tables(*key)
    return _DISCOUNT_CACHE[key]


def _discount_tables(gamma: float | torch.Tensor, n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(n, device=device, dtype=torch.float64)
    lag = i[None, :] - i[:, None]  # [t, k] -> k - t
    g = gamma.to(device=device, dtype=torch.float64) if torch.is_tensor(gamma) else float(gamma)  # no host copy
    # torch.where evaluates both branches: clamp the exponent so gamma=0 never sees 0 ** negative.
    mat = torch.where(lag >= 0, g ** lag.clamp(min=0), 0.0)
    carry = g ** (n - i)  # gamma^(distance to next block)
    return mat.to(dtype), carry.to(dtype)


def discounted_returns(adv: torch.Tensor, gamma: float, block: int = 128,
                       resets: torch.Tensor | None = None) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) A_k along the last dimension.

    ``resets`` bool [B, T]: True where a new piece starts (a forced start such as a packed
    document's SEP); the sum then stops before the next reset: G_t = A_t + gamma G_{t+1} except when
    t + 1 is a reset, where G_t = A_t.

    Vectorised: within blocks of ``block`` positions a small matrix product, then one reverse pass
    over blocks (T / block steps, not T) carries each block's first return into the block before.
    Powers of gamma never exceed the block length, so nothing under- or overflows on long sequences.
    """
    B, T = adv.shape
    n = min(block, T)
    pad = (-T) % n
    a = F.pad(adv.float(), (0, pad)).view(B, -1, n)  # [B, blocks, n]
    mat, carry_w = _discount_matrix(gamma, n, adv.device, torch.float32)
    if resets is None:
        local = a @ mat.T  # local[..., t] = sum_{k >= t in block} gamma^(k-t) a_k
        seg = None
    else:  # only terms from t's own piece: pieces are runs of equal cumulative reset counts
        seg = F.pad(resets.long(), (0, pad)).cumsum(1).view(B, -1, n)  # padding joins the last piece
        same = seg[..., :, None] == seg[..., None, :]  # [B, blocks, t, k]
        local = torch.einsum("bjtk,bjk->bjt", mat * same, a)
    out = torch.empty_like(local)
    carry = torch.zeros(B, device=adv.device)
    for j in range(local.shape[1] - 1, -1, -1):
        w = carry_w * carry[:, None]
        if seg is not None and j + 1 < local.shape[1]:
            w = w * (seg[:, j] == seg[:, j + 1, :1])  # the next block's first return, if in t's piece
        out[:, j] = local[:, j] + w
        carry = out[:, j, 0]
    return out.view(B, -1)[:, :T].to(adv.dtype)


def disarm_credit(returns: torch.Tensor, starts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """DisARM (Dong, Mnih & Tucker 2020) per decision, for rows that come in antithetic pairs: rows 2i and
    2i + 1 are one sequence whose decisions were drawn from the same uniforms u and 1 - u (b = [u < p],
    b~ = [1 - u < p]). Returns g [B / 2, T], an unbiased estimate of d E[G_t] / d logit_t for each pair:

        g_t = 1/2 (G_t(b) - G_t(b~)) (-1)^(b~_t) [b_t != b~_t] sigmoid(|logit_t|)

    (docs/method.md derives it for the discounted returns G_t, each a function of all the decisions).
    ``returns`` and ``starts`` are [B, T] over both rows of every pair, ``logits`` [B / 2, T] the pair's
    shared logits. Where the two draws agree the pair says nothing about t (g_t = 0); a baseline common to
    both rows cancels in the difference."""
    g_a, g_b = returns[0::2].float(), returns[1::2].float()
    b_a, b_b = starts[0::2], starts[1::2]
    sign = torch.where(b_b, -1.0, 1.0) * (b_a != b_b).float()
    return 0.5 * (g_a - g_b) * sign * torch.sigmoid(logits.float().abs())


def bernoulli_kl(logits: torch.Tensor, rate: float) -> torch.Tensor:
    """KL(Bernoulli(sigmoid(logits)) || Bernoulli(rate)) per position (nats): 0 at p = rate, its gradient
    with respect to the logit p (1 - p) (logit - logit(rate))."""
    p = torch.sigmoid(logits)
    return (p * (F.logsigmoid(logits) - math.log(rate)) + (1 - p) * (F.logsigmoid(-logits) - math.log1p(-rate)))


def policy_loss(log_probs: torch.Tensor, returns: torch.Tensor, decision_mask: torch.Tensor,
                weight: float) -> torch.Tensor:
    """-weight * mean over decisions of G_t * log pi(b_t), with G_t treated as a constant."""
    return -weight * masked_mean(returns.detach() * log_probs, decision_mask)


def rate_loss(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor, target: float,
              weight: float, per_sequence: bool = False) -> torch.Tensor:
    """weight * mean(l) * stopgrad(mean(p) - rho): pushes every logit down when the rate is above target.

    The means are over the micro-batch; with ``per_sequence`` the term is taken in each sequence and
    averaged over sequences, so every sequence is held at the target, not only their average."""
    if not per_sequence:
        return weight * masked_mean(logits, mask) * (masked_mean(probs, mask) - target).detach()
    m = mask.to(logits.dtype)
    n = m.sum(1)
    mean_l = (logits * m).sum(1) / n.clamp(min=1)
    mean_p = (probs * m).sum(1) / n.clamp(min=1)
    real = (n > 0).to(logits.dtype)
    return weight * (mean_l * (mean_p - target).detach() * real).sum() / real.sum().clamp(min=1)
