"""Per-sequence sums that every report is built from: bits per byte, chunk counts, boundary quality.

Sums (never means) so they add up over micro-batches, documents and ranks; :func:`ratios` turns a
total into the reported figures only at the end.
"""

from __future__ import annotations

import math

import torch

from megatok.vocab import PAD


@torch.no_grad()
def row_stats(x: torch.Tensor, y: torch.Tensor, starts: torch.Tensor, ce_full: torch.Tensor,
              ce_early: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 [B] per key: nll / nll_early (nats over byte targets: the SEP ids between packed
    documents are trained on but not counted, so bpb is over UTF-8 bytes only), targets, chunks
    (starts at real positions), positions (real inputs), ws_positions / ws_boundaries (whitespace
    bytes, and those that start a chunk)."""
    real, tmask = x != PAD, y < 256
    ws = real & ((x == 9) | (x == 10) | (x == 13) | (x == 32))
    cols = {
        "nll": (ce_full * tmask).sum(1),
        "nll_early": (ce_early * tmask).sum(1),
        "targets": tmask.sum(1),
        "chunks": (starts & real).sum(1),
        "positions": real.sum(1),
        "ws_positions": ws.sum(1),
        "ws_boundaries": (ws & starts).sum(1),
    }
    return {k: v.double() for k, v in cols.items()}


def ratios(s: dict[str, float]) -> dict[str, float]:
    """Reported figures from summed statistics (NaN where a denominator is zero)."""
    def div(a, b):
        return float(a) / float(b) if float(b) else float("nan")

    out = {
        "bpb": div(s["nll"], s["targets"]) / math.log(2),
        "bytes_per_chunk": div(s["positions"], s["chunks"]),
        "boundary_rate": div(s["chunks"], s["positions"]),
        "whitespace_boundary_fraction": div(s["ws_boundaries"], s["ws_positions"]),
    }
    if "nll_early" in s:
        out["bpb_early"] = div(s["nll_early"], s["targets"]) / math.log(2)
    return out
