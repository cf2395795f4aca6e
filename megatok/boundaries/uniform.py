"""Uniform random boundaries at the target rate: the "no information" comparison.

Over a window of S positions, round(rho x S) chunks start: the first byte and round(rho x S) - 1 other
positions drawn uniformly without replacement. S is the training window (``data.seq_len``; the
strategy's ``window``) or the row's width T when that is longer or unknown; a shorter row (an
evaluation window, padded to the widest of its batch) takes the first T positions of the same draw.
So the draw depends only on the random generator and on S, never on the bytes, a row's real length,
the batch's width or where documents start: no decision depends on the future of the text, and every
position after the first starts a chunk with probability (round(rho x S) - 1) / (S - 1), about rho.
Forced starts (with document masking, every SEP) are added on top. A full training window without
document masking has exactly round(rho x S) starts. Nothing is learned. In evaluation the draw is
seeded like any sampled boundary (megatok.eval.bpb).
"""

from __future__ import annotations

import torch

from megatok.boundaries.base import Boundaries, BoundaryStrategy, NoOptions, finalize_starts, uniform_noise

Options = NoOptions


def uniform_starts(mask: torch.Tensor, rate: float, generator: torch.Generator | None = None,
                   forced: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """bool [B, T]: over S = max(T, window) positions, t = 0 and round(rate x S) - 1 uniform draws from
    1..S-1, of which the first T are kept; plus ``forced``; on real bytes only."""
    B, T = mask.shape
    S = max(T, window or T)
    k = max(1, round(rate * S))  # Python's round(), half to even
    scores = (torch.rand(B, S, generator=generator, device=mask.device) if generator is not None
              else uniform_noise(torch.empty(B, S, device=mask.device)))
    scores[:, 0] = -1.0  # t = 0 first
    starts = (scores.argsort(1).argsort(1) < k)[:, :T]  # the k lowest scores of each row
    if forced is not None:
        starts |= forced
    return starts & mask


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask, forced) -> Boundaries:
        starts = uniform_starts(mask, self.target_rate, forced=forced, window=self.window)
        return Boundaries(starts=finalize_starts(starts, mask, forced))
