"""Fixed stride: a chunk starts every round(1 / rho) bytes. The simplest comparison; nothing learned."""

from __future__ import annotations

import torch

from megatok.boundaries.base import Boundaries, BoundaryStrategy, NoOptions, finalize_starts

Options = NoOptions


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask) -> Boundaries:
        stride = max(1, round(1 / self.target_rate))
        pos = torch.arange(x.shape[1], device=x.device)
        starts = (pos % stride == 0).expand(x.shape[0], -1).clone()
        return Boundaries(starts=finalize_starts(starts, mask))
