"""Uniform random boundaries at the target rate: the "no information" comparison.

In a window of T positions, round(rho x T) chunks start: the first byte and round(rho x T) - 1 other
positions drawn uniformly without replacement. The draw depends only on the random generator and on
T (a shape, ``data.seq_len`` in training), never on the bytes, their length or where documents start,
so no decision depends on the future of the text. Forced starts (with document masking, every SEP) are
added on top, and a padded row keeps the draws that fall on its real bytes: in expectation rho x L of
them for L real bytes. A full window without document masking has exactly round(rho x T) starts.
Nothing is learned. In evaluation the draw is seeded like any sampled boundary (megatok.eval.bpb).
"""

from __future__ import annotations

import torch

from megatok.boundaries.base import Boundaries, BoundaryStrategy, NoOptions, finalize_starts

Options = NoOptions


def uniform_starts(mask: torch.Tensor, rate: float, generator: torch.Generator | None = None,
                   forced: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, T]: t = 0 and round(rate x T) - 1 uniform draws from 1..T-1, plus ``forced``, on real bytes."""
    B, T = mask.shape
    k = max(1, round(rate * T))  # Python's round(), half to even
    scores = torch.rand(B, T, generator=generator, device=mask.device)
    scores[:, 0] = -1.0  # t = 0 first
    starts = scores.argsort(1).argsort(1) < k  # the k lowest scores of each row
    if forced is not None:
        starts |= forced
    return starts & mask


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask, forced) -> Boundaries:
        starts = uniform_starts(mask, self.target_rate, forced=forced)
        return Boundaries(starts=finalize_starts(starts, mask, forced))
