"""The window > 1 policy's decisions without a loop over positions: a parallel scan over a finite state.

The policy with window w decides, at every position t of a row (megatok/boundaries/policy.py)::

    l_t = c tanh((base_t + sum_k weights_t[k-1] b_{t-k}) / c),  k = 1 .. w-1
    b_t = (noise_t < sigmoid(l_t)) ("sample") or sigmoid(l_t) > 0.5 ("threshold"),
    b_t = (b_t or forced_t) and mask_t,

reading the w - 1 decisions before t (0 before the row and before the latest forced start, where they
are forgotten). Each decision reads the ones before it, so :func:`draw_loop` (the reference) walks the
positions one at a time: about 25 small kernels per byte, 100k launches per 4096-byte micro-batch.

But the decisions before t are one of S = 2^(w-1) states, and for every position and every state the
decision can be computed at once, with no dependence between positions. Each position is then a map
from the state before it to the state after it; composing those maps along the row is associative,
so a parallel prefix scan (Hillis-Steele: log2 L steps, each one gather over [B, L, S]) gives every
position's state from the row's first one. :func:`draw_scan` does that over blocks of L positions
(one after another, each starting from the state the previous one ended in), L chosen so that a
block's tables hold at most ``budget`` elements: O(B T S (w + log L)) work, T / L sequential steps.

It computes the same numbers as the loop, in the same order (the window's sum over the same w - 1
products, then the same elementwise ops), so the decisions are the loop's exactly
(tests/boundaries/test_scan.py). :func:`draw` takes the scan up to ``MAX_SCAN_WINDOW`` (S = 4096
states; on a CPU ``MAX_SCAN_WINDOW_CPU``), the loop beyond.
"""

from __future__ import annotations

import torch

#: The largest window drawn by the scan (2^(w-1) states per position); longer windows use the loop. On a
#: CPU, where the loop's steps are cheap, the scan's work (2^(w-1) states) outgrows them sooner: at 16 x
#: 4096 bytes, one thread, w = 3: 169 -> 24 ms, w = 6: 185 -> 145 ms, w = 8: 183 -> 524 ms.
MAX_SCAN_WINDOW = 13
MAX_SCAN_WINDOW_CPU = 6


def _decide(logit: torch.Tensor, noise: torch.Tensor, cap: float, mode: str) -> torch.Tensor:
    p = torch.sigmoid(cap * torch.tanh(logit / cap))
    return (noise < p) if mode == "sample" else (p > 0.5)


@torch.no_grad()
def draw_loop(base: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
              forced: torch.Tensor, cap: float, mode: str) -> torch.Tensor:
    """The reference: one position at a time. ``base``, ``noise`` [B, T] float, ``weights`` [B, T, w-1]
    (weights[..., k-1] multiplies b_{t-k}), ``mask``, ``forced`` [B, T] bool -> decisions [B, T] bool."""
    B, T = base.shape
    starts = torch.zeros(B, T, dtype=torch.bool, device=base.device)
    prev = torch.zeros(B, weights.shape[-1], device=base.device)  # b_{t-1}, ..., b_{t-w+1}
    for t in range(T):
        prev = prev * ~forced[:, t, None]  # a forced start forgets the decisions before it
        b = _decide(base[:, t] + (weights[:, t] * prev).sum(-1), noise[:, t], cap, mode)
        b = (b | forced[:, t]) & mask[:, t]
        starts[:, t] = b
        prev = torch.cat([b.float()[:, None], prev[:, :-1]], 1)
    return starts


@torch.no_grad()
def draw_scan(base: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
              forced: torch.Tensor, cap: float, mode: str, budget: int = 1 << 22) -> torch.Tensor:
    """The same decisions as :func:`draw_loop`, by a scan over the 2^(w-1) window states.

    State s holds b_{t-1-j} in bit j. Per position, for every state: the decision ``d`` (the state is
    taken as 0 at a forced start) and the next state ((s << 1) | d) mod S (at a forced start: d)."""
    B, T = base.shape
    n = weights.shape[-1]  # w - 1
    S = 1 << n
    dev = base.device
    states = torch.arange(S, device=dev)
    bits = ((states[:, None] >> torch.arange(n, device=dev)) & 1).to(weights.dtype)  # [S, w-1]
    L = max(1, min(T, budget // max(1, B * S * n)))
    starts = torch.empty(B, T, dtype=torch.bool, device=dev)
    state = torch.zeros(B, 1, dtype=torch.long, device=dev)  # before the block
    for lo in range(0, T, L):
        hi = min(T, lo + L)
        f = forced[:, lo:hi, None]  # [B, L, 1]
        prev = bits * ~f[..., None]  # [B, L, S, w-1]: what the loop's prev holds in each state
        logit = base[:, lo:hi, None] + (weights[:, lo:hi, None, :] * prev).sum(-1)  # [B, L, S]
        d = _decide(logit, noise[:, lo:hi, None], cap, mode)
        d = (d | f) & mask[:, lo:hi, None]  # [B, L, S]
        nxt = torch.where(f, d.long(), ((states << 1) | d.long()) & (S - 1))  # [B, L, S]
        # maps[:, t] = the map from the block's first state to the state after t (Hillis-Steele)
        maps, shift = nxt, 1
        while shift < hi - lo:
            maps = torch.cat([maps[:, :shift], maps[:, shift:].gather(2, maps[:, :-shift])], 1)
            shift *= 2
        before = torch.cat([state, maps[:, :-1].gather(2, state[:, :, None].expand(B, hi - lo - 1, 1))[..., 0]], 1)
        starts[:, lo:hi] = d.gather(2, before[..., None])[..., 0]
        state = maps[:, -1:].gather(2, state[:, :, None])[..., 0]
    return starts


def draw(base: torch.Tensor, weights: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
         forced: torch.Tensor, cap: float, mode: str) -> torch.Tensor:
    """Decisions [B, T] bool: :func:`draw_scan` for windows up to MAX_SCAN_WINDOW (a CPU's: MAX_SCAN_WINDOW_CPU),
    else :func:`draw_loop`."""
    if mode not in ("sample", "threshold"):
        raise ValueError(f"mode must be 'sample' or 'threshold', got {mode!r}")
    if weights.shape[-1] + 1 <= (MAX_SCAN_WINDOW if base.is_cuda else MAX_SCAN_WINDOW_CPU):
        return draw_scan(base, weights, noise, mask, forced, cap, mode)
    return draw_loop(base, weights, noise, mask, forced, cap, mode)
