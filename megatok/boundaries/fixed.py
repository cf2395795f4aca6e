"""Fixed stride: a chunk starts every round(1 / rho) bytes, counted from the latest forced start (the
window's start, or with document masking the document's). The simplest comparison; nothing learned."""

from __future__ import annotations

import torch

from megatok.boundaries.base import Boundaries, BoundaryStrategy, NoOptions, finalize_starts, since_forced

Options = NoOptions


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask, forced) -> Boundaries:
        stride = max(1, round(1 / self.target_rate))
        starts = since_forced(forced) % stride == 0
        return Boundaries(starts=finalize_starts(starts, mask, forced))
