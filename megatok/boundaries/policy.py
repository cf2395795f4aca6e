"""The score-function (REINFORCE) boundary policy, the method megatok exists for.

A linear head on each encoder state gives a soft-capped logit l_t = c * tanh(f(h_t) / c); in
training b_t ~ Bernoulli(sigmoid(l_t)), with b_1 = 1 forced. After the forward pass, the reward at
t is how much the full model beats the early-exit head on the prediction made at t
(CE_early - CE_full, detached); a batch-relative baseline and discounted returns
G_t = sum_k gamma^(k-t) A_k turn it into the credit for the decision at t. See
shared/design/method.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from megatok import rl
from megatok.boundaries.base import Boundaries, BoundaryStrategy, finalize_starts


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gamma: float = Field(0.99, ge=0, le=1, description="discount of future advantages")
    logit_cap: float = Field(6.0, gt=0, description="soft cap c: logit = c tanh(f(h) / c)")
    lambda_policy: float = Field(0.01, ge=0, description="weight of the policy-gradient loss")
    lambda_rate: float = Field(0.01, ge=0, description="weight of the rate loss holding p at target_rate")
    batch_baseline: bool = Field(True, description="subtract the micro-batch mean reward at each position")
    early_exit_reward: bool = Field(True, description="reward CE_early - CE_full; off: reward -CE_full")


class Strategy(BoundaryStrategy):
    def __init__(self, *, d_model, target_rate, options: Options):
        super().__init__(d_model=d_model, target_rate=target_rate, options=options)
        self.head = nn.Linear(d_model, 1)
        nn.init.normal_(self.head.weight, std=0.02 / math.sqrt(d_model))
        # Bias such that the capped logit starts at logit(rho), i.e. p starts at the target rate.
        c = options.logit_cap
        target_logit = math.log(target_rate / (1 - target_rate))
        nn.init.constant_(self.head.bias, c * math.atanh(max(-0.999, min(0.999, target_logit / c))))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        c = self.options.logit_cap
        return c * torch.tanh(self.head(h).squeeze(-1).float() / c)

    def forward(self, h, x, mask) -> Boundaries:
        logits = self.logits(h)
        probs = torch.sigmoid(logits)
        mode = "sample" if self.training else self.eval_mode
        if mode == "sample":
            starts = torch.rand_like(probs) < probs
        else:  # "threshold". (A "top rho fraction per sequence" rule would look at later bytes: not causal.)
            starts = probs > 0.5
        starts = finalize_starts(starts.detach(), mask)
        log_probs = torch.where(starts, F.logsigmoid(logits), F.logsigmoid(-logits))
        return Boundaries(starts=starts, log_probs=log_probs, probs=probs, extra={"logits": logits})

    def loss(self, b, ce_full, ce_early, mask):
        o = self.options
        reward = (ce_early - ce_full) if o.early_exit_reward else -ce_full
        reward = reward.detach().float() * mask
        adv = rl.batch_baseline(reward, mask) if o.batch_baseline else reward
        returns = rl.discounted_returns(adv, o.gamma)
        decisions = mask.clone()
        decisions[:, 0] = False  # b_1 is forced: no gradient
        return {
            "policy_loss": rl.policy_loss(b.log_probs, returns, decisions, o.lambda_policy),
            "rate_loss": rl.rate_loss(b.extra["logits"], b.probs, mask, self.target_rate, o.lambda_rate),
        }
