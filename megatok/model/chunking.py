"""Downsample bytes to chunks and upsample chunks back to bytes.

A chunk starts at every position with ``starts[b, t] = True`` (always at t = 0). Downsampling keeps
the encoder state at each start, in order; sequences with fewer chunks are padded at the end, so a
causal main network never lets a pad chunk reach a real one. Upsampling gives byte t the main
network's output for the latest chunk that starts at or before t: that chunk summarises bytes
<= its start <= t, so nothing from the future leaks. Indices come from integer cumulative sums.
"""

from __future__ import annotations

import torch


def chunk_index(starts: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B, T] long: the index of the chunk each byte belongs to."""
    return starts.long().cumsum(1) - 1


def downsample(h: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, D] states -> ([B, K, D] chunk states, [B, K] start positions, [B, K] bool real-chunk mask)."""
    B, T, D = h.shape
    counts = starts.sum(1)
    K = int(counts.max())
    t = torch.arange(T, device=h.device)
    key = torch.where(starts, t, t + T)  # starts first, in order; the rest after
    positions = key.argsort(1)[:, :K]
    chunks = h.gather(1, positions[..., None].expand(B, K, D))
    real = torch.arange(K, device=h.device)[None, :] < counts[:, None]
    return chunks, positions, real


def upsample(z: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[B, K, D] chunk outputs -> [B, T, D]: byte t gets its chunk's output."""
    idx = chunk_index(starts)
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
