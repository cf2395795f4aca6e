"""Downsample bytes to chunks and upsample chunks back to bytes.

A chunk starts at every position with ``starts[b, t] = True`` (always at t = 0). Downsampling keeps
the encoder state at each start, in order; sequences with fewer chunks are padded at the end, so a
causal main network never lets a pad chunk reach a real one. Upsampling gives byte t the main
network's output for the latest chunk that starts at or before t: that chunk summarises bytes
<= its start <= t, so nothing from the future leaks. Indices come from integer cumulative sums.

How many chunks a batch keeps (K, the main network's length) is :func:`chunk_layout`: on a GPU the
batch's largest count rounded up to one of a few sizes (:func:`bucket`), so that compiled code sees a
handful of lengths rather than a new one every batch; the rounding adds pad chunks at the end only. Reading
the largest count is a device-to-host sync per forward. A ``capacity`` (chunks per byte) caps K at
what the window's length allows, so memory is bounded whatever the boundaries do: the starts past it
in a row join the chunk before them (upsampling clamps to the last kept chunk, which started earlier:
still causal); a ``static`` capacity fixes K from the window's length alone, with no sync.

:func:`pack` is the other layout (``model.pack_chunks``): every row's chunks one after another in one
sequence of a fixed length N for the whole micro-batch, the rows and documents kept apart by the main
network's attention mask (a segment id per chunk), with no host read and no data-dependent shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_index(starts: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T] long: the index of the chunk each byte belongs to."""
    return starts.long().cumsum(1) - 1


def bucket(n: int) -> int:
    """``n`` rounded up to one of 8 sizes per octave: a multiple of 8 up to 64, then of 2^(floor(log2 n) - 3)
    (at most 12.5% more)."""
    if n <= 64:
        return max(8, -(-n // 8) * 8)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def chunk_slots(starts: torch.Tensor, capacity: float | None = None) -> int:
    """K for a batch of starts [B, T]: the largest count of starts in a row, rounded up by :func:`bucket`
    (one device-to-host sync), or with ``capacity`` bucket(ceil(capacity x T)) (no sync; rows with more
    starts lose their last ones to the chunk before them). Never more than T."""
    T = starts.shape[1]
    n = int(starts.sum(1).max()) if capacity is None else math.ceil(capacity * T)
    return min(T, bucket(n))


def chunk_layout(starts: torch.Tensor, capacity: float | None = None, waste: float = 0.05,
                 bucketed: bool | None = None, static: bool = False) -> tuple[int, torch.Tensor | None]:
    """(K, rows) for a batch of starts [B, T]: K as :func:`chunk_slots` (``bucketed``, the default on a
    GPU, where compiled code wants few lengths; else the largest count itself: on a CPU, eager, the
    rounding's pads only cost), from the same single host sync, and the flat indices (into B * K) of the
    real chunks when the pad chunks would be more than ``waste`` of the B * K, for the main network to
    skip the pads (megatok.model.blocks.Packed); else None (all rows: the gathers would cost more than
    the pads). A ``capacity`` caps K at its chunk_slots (rows with more starts keep their first K);
    ``static``: K is the capacity's, (K, None), with no sync."""
    if capacity is not None and static:
        return chunk_slots(starts, capacity), None
    B, T = starts.shape
    counts = starts.sum(1).tolist()  # the one host sync; Python numbers from here
    n = max(counts)
    K = min(T, bucket(n)) if (starts.is_cuda if bucketed is None else bucketed) else n
    if capacity is not None:
        K = min(K, chunk_slots(starts, capacity))
        counts = [min(c, K) for c in counts]
    if sum(counts) >= (1 - waste) * B * K:
        return K, None
    rows = torch.cat([torch.arange(b * K, b * K + c) for b, c in enumerate(counts)])
    return K, rows.to(starts.device, non_blocking=True)


def downsample(h: torch.Tensor, starts: torch.Tensor, K: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, D] states -> ([B, K, D] chunk states, [B, K] start positions, [B, K] bool real-chunk mask).

    ``K`` (see :func:`chunk_slots`) defaults to the largest count of starts in a row. Pad chunks (past a
    row's count) hold the state at T - 1 and come after every real chunk; a row with more than K starts
    keeps its first K."""
    B, T, D = h.shape
    counts = starts.sum(1)
    if K is None:
        K = int(counts.max())
    # the k-th start (k = 1..K) is the first position where the running count of starts reaches k
    running = starts.long().cumsum(1)
    k = torch.arange(1, K + 1, device=h.device).expand(B, K).contiguous()
    positions = torch.searchsorted(running, k).clamp_(max=T - 1)
    chunks = h.gather(1, positions[..., None].expand(B, K, D))
    real = k <= counts[:, None]
    return chunks, positions, real


def upsample(z: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[B, K, D] chunk outputs -> [B, T, D]: byte t gets its chunk's output (past the K-th chunk: the K-th's)."""
    idx = chunk_index(starts).clamp(max=z.shape[1] - 1)
    return z.gather(1, idx[..., None].expand(-1, -1, z.shape[-1]))


def ema_over_chunks(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Smooth chunk outputs along the chunk axis: out_j = p_j z_j + (1 - p_j) out_{j-1}, out_{-1} = 0.

    ``z`` [B, K, D], ``p`` [B, K] in [0, 1]. A linear recurrence out_j = a_j out_{j-1} + u_j
    (a = 1 - p, u = p z) computed by a parallel prefix scan (Hillis-Steele): log2(K) vectorised
    steps, each combining every element with the one ``shift`` before it; no loop over chunks,
    no logarithms (a may be exactly 0). out_j depends on chunks <= j only, so it is causal and the
    pad chunks at the end never reach a real one.
    """
    B, K, D = z.shape
    a = (1 - p).to(z.dtype)
    u = p.to(z.dtype)[..., None] * z
    shift = 1
    while shift < K:
        # (a, u)_j <- (a_j a_{j-shift}, u_j + a_j u_{j-shift}); positions < shift are already final.
        u = torch.cat([u[:, :shift], u[:, shift:] + a[:, shift:, None] * u[:, :-shift]], 1)
        a = torch.cat([a[:, :shift], a[:, shift:] * a[:, :-shift]], 1)
        shift *= 2
    return u


def packed_length(rows: int, T: int, rate: float, slack: float) -> int:
    """N, the packed sequence's length: rate x rows x T x slack, rounded up by :func:`bucket`, at most rows x T."""
    return min(rows * T, bucket(math.ceil(rate * slack * rows * T)))


@dataclass
class Packing:
    """Where a micro-batch's chunks sit in the packed sequence of length N. ``starts`` [B, T]: the starts
    kept; ``dropped`` [B]: starts each row lost to the length; ``src`` [N]: the flat position (b T + t) of
    slot j's start (the last real one's for the slots past them); ``positions`` [N]: its byte position t in
    its row; ``segments`` [N]: the row and document it belongs to (slots past the real ones: each its own);
    ``chunk_of`` [B x T]: the slot of each byte's chunk."""

    starts: torch.Tensor
    dropped: torch.Tensor
    src: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    chunk_of: torch.Tensor


def pack(starts: torch.Tensor, forced: torch.Tensor, N: int, docs: torch.Tensor | None = None) -> Packing:
    """The packed layout of ``starts`` [B, T] (bool, a start at every row's t = 0) in N slots, on the device.

    When the micro-batch has more than N starts, the ones kept are those earliest in their row: forced starts
    (t = 0, documents) first, then each row's first start, each row's second, ... (ties: the earlier row), so
    the rows with the most starts lose their last ones; a dropped start's bytes join the chunk before it
    (still causal). Deterministic; one sort of B x T keys, no host read."""
    B, T = starts.shape
    flat = starts.reshape(-1)
    rank = torch.where(forced, torch.zeros_like(starts, dtype=torch.long), starts.long().cumsum(1)).reshape(-1)
    key = torch.where(flat, rank, torch.full_like(rank, T + 1))
    order = torch.sort(key, stable=True).indices
    keep = torch.zeros_like(flat)
    keep[order[:N]] = True
    keep &= flat
    kept = keep.view(B, T)
    cum = keep.long().cumsum(0)
    src = torch.searchsorted(cum, torch.arange(1, N + 1, device=starts.device)).clamp_(max=B * T - 1)
    real = torch.arange(N, device=starts.device) < cum[-1]
    src = torch.where(real, src, src.gather(0, (cum[-1] - 1).clamp(min=0).expand(N)))
    row = src // T
    doc = docs.reshape(-1).gather(0, src) if docs is not None else torch.zeros_like(src)
    segments = torch.where(real, row * (T + 1) + doc, -1 - torch.arange(N, device=starts.device))
    return Packing(starts=kept, dropped=starts.sum(1) - kept.sum(1), src=src, positions=src % T,
                   segments=segments, chunk_of=cum - 1)
