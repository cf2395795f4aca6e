"""H-Net's cosine router (Hwang, Wang & Gu, 2025): the straight-through comparison.

    q_t = Wq h_t, k_t = Wk h_t                      (Wq, Wk initialised to the identity)
    p_t = (1 - cos(q_{t-1}, k_t)) / 2,  p_1 = 1      a boundary where the state changes direction
                                                    (p = 1 at every forced start, e.g. a document's)
    b_t = [p_t > 0.5]                                deterministic, in training and evaluation

Gradients reach the router in two ways, both through the model's generic hooks:

- ``gate``: the upsampled chunk output at byte t is multiplied by a straight-through confidence,
  forward value 1 and gradient of c_t = p_t where b_t = 1, 1 - p_t where b_t = 0 (= max(p_t, 1 - p_t)
  for the router's own decisions);
- ``smooth``: the main network's chunk outputs are smoothed by an EMA over chunks before upsampling,
  z_j = P_j zhat_j + (1 - P_j) z_{j-1}, P_j = p at chunk j's start (a confident boundary keeps its
  own output, a doubtful one blends in the previous chunk's).

The rate is held by the ratio loss with N = 1 / rho, F = fraction of positions selected (no
gradient), G = mean p:  L_ratio = weight x N / (N - 1) x ((N - 1) F G + (1 - F)(1 - G)). On F = G it
is minimised (value 1) at F = G = 1 / N. It is logged as ``rate_loss``.

Causal: p_t reads h_{t-1} and h_t, and the EMA at chunk j reads chunks <= j.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from megatok.boundaries.base import Boundaries, BoundaryStrategy, finalize_starts, initialise, straight_through
from megatok.rl import masked_mean


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ratio_weight: float = Field(0.03, ge=0, description="hnet: weight of the ratio loss holding the rate at target_rate")
    smoothing: bool = Field(True, description="hnet: EMA over chunks in the upsampler (off: plain upsampling)")


def ratio_loss(starts: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor, target_rate: float) -> torch.Tensor:
    """N / (N - 1) ((N - 1) F G + (1 - F)(1 - G)), N = 1 / target_rate (unweighted)."""
    n = 1.0 / target_rate
    f = masked_mean(starts.float(), mask).detach()
    g = masked_mean(probs, mask)
    return n / (n - 1) * ((n - 1) * f * g + (1 - f) * (1 - g))


class Strategy(BoundaryStrategy):
    reach = 1  # p_t reads h_{t-1} and h_t
    def __init__(self, *, d_model, target_rate, options: Options):
        super().__init__(d_model=d_model, target_rate=target_rate, options=options)
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        for w in (self.wq, self.wk):
            initialise(w, lambda m: nn.init.eye_(m.weight))

    @classmethod
    def param_count(cls, options: Options, *, d_model: int, target_rate: float) -> int:
        """Wq and Wk, d x d each, no bias."""
        return 2 * d_model * d_model

    def probs(self, h: torch.Tensor) -> torch.Tensor:
        q, k = self.wq(h).float(), self.wk(h).float()
        cos = F.cosine_similarity(q[:, :-1], k[:, 1:], dim=-1, eps=1e-6)
        p = ((1 - cos) / 2).clamp(0, 1)
        return F.pad(p, (1, 0), value=1.0)  # p_1 = 1

    def forward(self, h, x, mask, forced) -> Boundaries:
        p = self.probs(h).masked_fill(forced, 1.0)  # nothing before a forced start reaches past it
        starts = finalize_starts((p > 0.5).detach(), mask, forced)
        confidence = torch.where(starts, p, 1 - p)
        return Boundaries(starts=starts, probs=p, gate=straight_through(confidence),
                          smooth=p if self.options.smoothing else None)

    def loss(self, b, ce_full, ce_early, mask):
        return {"rate_loss": self.options.ratio_weight * ratio_loss(b.starts, b.probs, mask, self.target_rate)}
