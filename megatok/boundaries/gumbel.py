"""Gumbel-sigmoid boundaries (Dynamic Token Pooling, Nawrot et al., 2023): a relaxed-Bernoulli
straight-through comparison.

A linear head gives a logit l_t = f(h_t) (bias initialised at logit(rho)). In training

    y_t = sigmoid((l_t + g_t) / tau),  g_t = log u - log(1 - u), u ~ U(0, 1)   (relaxed Bernoulli)
    b_t = [y_t > 0.5]                                                           (= Bernoulli(sigmoid(l_t)))
    hard_t = b_t + y_t - stopgrad(y_t)      forward exactly b_t, backward the relaxed sample's gradient

Evaluation samples the same way (seeded) or, with the "threshold" rule, takes b_t = [l_t > 0].
The hard sample reaches the model's loss through the generic ``gate``: the upsampled chunk output
at byte t is multiplied by a straight-through confidence with forward value 1 and the gradient of
hard_t where b_t = 1 and of 1 - hard_t where b_t = 0 (the relaxed sample's confidence in its own
decision, as H-Net does with p). The rate is held by DTP's binomial prior: per sequence with n real
bytes and k = sum_t hard_t boundaries (a straight-through count),

    L_prior = weight x mean over sequences of -log Binomial(k; n, rho) / n,

logged as ``rate_loss``. Causal: b_t reads h_t and its own noise only.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from megatok.boundaries.base import (Boundaries, BoundaryStrategy, finalize_starts, initialise, straight_through,
                                    uniform_noise)


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(0.5, gt=0, description="gumbel: temperature tau of the relaxed Bernoulli sample")
    prior_weight: float = Field(1.0, ge=0, description="gumbel: weight of the binomial prior loss toward target_rate")


def relaxed_bernoulli(logits: torch.Tensor, temperature: float, noise: torch.Tensor | None = None) -> torch.Tensor:
    """A sample of the relaxed Bernoulli: sigmoid((l + logistic noise) / tau)."""
    if noise is None:
        u = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
        noise = torch.log(u) - torch.log1p(-u)
    return torch.sigmoid((logits + noise) / temperature)


def harden(y: torch.Tensor) -> torch.Tensor:
    """Straight-through hardening at 0.5: forward exactly [y > 0.5] in {0, 1}, gradient of y."""
    hard = (y > 0.5).to(y.dtype)
    return hard + (y - y.detach())


def binomial_prior_loss(hard: torch.Tensor, mask: torch.Tensor, rate: float) -> torch.Tensor:
    """mean over sequences with real bytes of -log Binomial(k; n, rate) / n, k = sum of ``hard``."""
    m = mask.to(hard.dtype)
    n, k = m.sum(1), (hard * m).sum(1)
    k = torch.minimum(k, n)
    log_pmf = (torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
               + k * math.log(rate) + (n - k) * math.log1p(-rate))
    rows = n > 0
    return -(log_pmf[rows] / n[rows]).sum() / rows.sum().clamp(min=1)


class Strategy(BoundaryStrategy):
    reach = 0  # b_t reads h_t and its noise
    def __init__(self, *, d_model, target_rate, options: Options):
        super().__init__(d_model=d_model, target_rate=target_rate, options=options)
        self.head = nn.Linear(d_model, 1)

        def init_head(m):
            nn.init.normal_(m.weight, std=0.02 / math.sqrt(d_model))
            nn.init.constant_(m.bias, math.log(target_rate / (1 - target_rate)))

        initialise(self.head, init_head)

    @classmethod
    def param_count(cls, options: Options, *, d_model: int, target_rate: float) -> int:
        """The d -> 1 head with its bias."""
        return d_model + 1

    def forward(self, h, x, mask, forced) -> Boundaries:
        logits = self.head(h).squeeze(-1).float()
        u = uniform_noise(logits, self.window).clamp(1e-6, 1 - 1e-6)  # always drawn: the same ops on every call
        y = relaxed_bernoulli(logits, self.options.temperature, torch.log(u) - torch.log1p(-u))
        if self.training or self.eval_mode == "sample":
            hard = harden(y)
        else:  # "threshold": the noise-free decision
            hard = harden(torch.sigmoid(logits))
        hard = torch.where(mask, hard, torch.zeros_like(hard))
        hard = torch.where(forced, torch.ones_like(hard), hard)  # b_1 = 1 (and any forced start): no gradient
        starts = finalize_starts(hard.detach() > 0.5, mask, forced)
        confidence = torch.where(starts, hard, 1 - hard)
        return Boundaries(starts=starts, probs=torch.sigmoid(logits), gate=straight_through(confidence),
                          extra={"hard": hard, "logits": logits})

    def loss(self, b, ce_full, ce_early, mask):
        o = self.options
        return {"rate_loss": o.prior_weight * binomial_prior_loss(b.extra["hard"], mask, self.target_rate)}
