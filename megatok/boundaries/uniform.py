"""Uniform random boundaries at exactly the target rate: the "no information" comparison.

Per sequence with L real bytes, exactly max(1, round(rho x L)) chunks start: the first byte (forced)
and round(rho x L) - 1 positions drawn uniformly without replacement from bytes 1..L-1. The draw is
independent of the byte values, so no decision depends on the future of the text; it depends only
on the random generator and on the sequence's length (the whole window in packed training). Nothing
is learned. In evaluation the draw is seeded like any sampled boundary (megatok.eval.bpb).
"""

from __future__ import annotations

import torch

from megatok.boundaries.base import Boundaries, BoundaryStrategy, NoOptions, finalize_starts

Options = NoOptions


def uniform_starts(mask: torch.Tensor, rate: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """bool [B, T]: exactly max(1, round(rate x L)) starts per row (L = real length), t = 0 included."""
    B, T = mask.shape
    lengths = mask.sum(1)
    # torch.round rounds half to even, like Python's round()
    k = torch.round(lengths.double() * rate).long().clamp(min=1)
    scores = torch.rand(B, T, generator=generator, device=mask.device)
    scores = torch.where(mask, scores, 2.0)  # padding last
    scores[:, 0] = -1.0  # the forced first start comes first
    rank = scores.argsort(1).argsort(1)  # rank of each position within its row
    return (rank < k[:, None]) & mask


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask) -> Boundaries:
        starts = uniform_starts(mask, self.target_rate)
        return Boundaries(starts=finalize_starts(starts, mask))
