"""Uniform random boundaries at exactly the target rate: the "no information" comparison.

Per sequence with L real bytes, exactly max(F, round(rho x L)) chunks start: the F forced starts (the
first byte; with document masking also every SEP) and the rest drawn uniformly without replacement
from the other real bytes. The draw is
independent of the byte values, so no decision depends on the future of the text; it depends only
on the random generator and on the sequence's length (the whole window in packed training). Nothing
is learned. In evaluation the draw is seeded like any sampled boundary (megatok.eval.bpb).
"""

from __future__ import annotations

import torch

from megatok.boundaries.base import Boundaries, BoundaryStrategy, NoOptions, finalize_starts

Options = NoOptions


def uniform_starts(mask: torch.Tensor, rate: float, generator: torch.Generator | None = None,
                   forced: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, T]: exactly max(F, round(rate x L)) starts per row (L = real length, F = forced starts,
    t = 0 always among them)."""
    B, T = mask.shape
    if forced is None:
        forced = torch.zeros_like(mask)
    forced = forced & mask
    forced[:, 0] = True
    lengths = mask.sum(1)
    # torch.round rounds half to even, like Python's round()
    k = torch.maximum(torch.round(lengths.double() * rate).long(), forced.sum(1))
    scores = torch.rand(B, T, generator=generator, device=mask.device)
    scores = torch.where(mask, scores, 2.0)  # padding last
    scores = torch.where(forced, -1.0, scores)  # the forced starts come first
    rank = scores.argsort(1).argsort(1)  # rank of each position within its row
    return (rank < k[:, None]) & mask


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask, forced) -> Boundaries:
        starts = uniform_starts(mask, self.target_rate, forced=forced)
        return Boundaries(starts=finalize_starts(starts, mask, forced))
