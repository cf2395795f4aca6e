"""Generation caches: every layer's keys and values for a batch of rows, preallocated, each row at its own length.

A :class:`KVCache` holds one or more Stacks' layers: ``k``, ``v`` [layers, B, H, S, Dh] in the model's dtype
and ``lengths`` [B], the positions each row holds. Before a stack runs, the model says what it writes:

- :meth:`KVCache.prefill`: the stack reads a batch of prompts ([len(rows), T], right-padded). Each layer
  writes its keys and values at positions 0..T-1 of those rows and attends as it would without a cache
  (causal over the prompt, or the document mask); the model then sets the rows' lengths.
- :meth:`KVCache.extend`: one new position per row (all rows, or some), written at the row's length; each
  layer attends over the row's positions up to and including it, through one additive mask [B, 1, 1, L]
  that the stack's layers share. ``window`` w makes it the row's last w positions (a sliding window:
  only the mask changes). The lengths then grow by one (or by ``grow``).

Rows of different lengths need no padding on the left and no shifting: a row writes where it is. Positions
past a row's length hold stale values that no mask lets through. ``extend(limit=None)`` attends over the
whole capacity with fixed shapes and no host sync (what a CUDA graph captures); otherwise over the first
``limit`` positions (the longest row's, known on the host).

:class:`ByteCache` and :class:`TokenCache` are what ByteUNet.step and TokenLM.step read and write.
"""

from __future__ import annotations

import torch


class _Plan:
    __slots__ = ("prefill", "rows", "at", "mask", "limit")


class _Layer:
    """The attention hook of one layer: ``kv(k, v, mask) -> (k, v, mask, causal)`` (megatok.model.blocks)."""

    def __init__(self, cache: "KVCache", i: int):
        self.cache, self.i = cache, i
        self.index = torch.tensor(i, device=cache.k.device)  # (an index tensor, made once: no host read)

    def __call__(self, k: torch.Tensor, v: torch.Tensor, mask):
        c, p = self.cache, self.cache.plan
        if k.dtype != c.dtype:  # (autocast)
            k, v = k.to(c.dtype), v.to(c.dtype)
        if p.prefill:  # [B', H, T, Dh] at positions 0..T-1 of the rows; attention as without a cache
            T = k.shape[2]
            c.k[self.i, p.rows, :, :T] = k
            c.v[self.i, p.rows, :, :T] = v
            return k, v, mask, True
        if k.shape[2] != 1:
            raise ValueError("a filled cache takes one position per row at a time")
        # one write per tensor, into the buffer itself (not a view of it: a compiled step then writes in
        # place instead of copying the buffer): layer i, row b, head h at the row's position (extend's index)
        at = (self.index, *p.at)
        c.k.index_put_(at, k[:, :, 0])
        c.v.index_put_(at, v[:, :, 0])
        if p.rows is None:
            return c.k[self.i, :, :, :p.limit], c.v[self.i, :, :, :p.limit], p.mask, False
        return c.k[self.i, p.rows, :, :p.limit], c.v[self.i, p.rows, :, :p.limit], p.mask, False


class KVCache:
    """Keys and values of ``n_layers`` attention layers for ``batch`` rows of up to ``capacity`` positions.
    ``cache[i]`` is layer i's hook (Stack passes it to the layer's attention)."""

    def __init__(self, n_layers: int, batch: int, heads: int, head_dim: int, capacity: int, *, device, dtype,
                 window: int | None = None):
        self.k = torch.zeros(n_layers, batch, heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.capacity, self.window, self.dtype = capacity, window, dtype
        self.layers = [_Layer(self, i) for i in range(n_layers)]
        self.plan = _Plan()
        self._arange = torch.arange(capacity, device=device)
        self._heads = torch.arange(heads, device=device)
        self._all = torch.arange(batch, device=device)

    def __getitem__(self, i: int) -> _Layer:
        return self.layers[i]

    def prefill(self, rows: torch.Tensor) -> None:
        """The next stack run reads one prompt per row of ``rows`` (right-padded)."""
        self.plan.prefill, self.plan.rows = True, rows

    def extend(self, rows: torch.Tensor | None = None, limit: int | None = None,
               grow: torch.Tensor | None = None) -> None:
        """The next stack run reads one new position per row of ``rows`` (None: every row), attending over
        the first ``limit`` positions (None: the capacity); then each such row's length grows by one (or by
        ``grow``, per row of ``rows``: 0 keeps what was written out of the row's positions)."""
        p = self.plan
        p.prefill, p.rows, p.limit = False, rows, limit or self.capacity
        index = self._all if rows is None else rows
        pos = self.lengths.clone() if rows is None else self.lengths[rows]
        p.at = (index[:, None], self._heads[None, :], pos[:, None])  # [B', H] after the layer's index
        j = self._arange[:p.limit]
        allowed = j[None, :] <= pos[:, None]
        if self.window is not None:
            allowed &= j[None, :] > pos[:, None] - self.window
        p.mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))[:, None, None]
        step = 1 if grow is None else grow  # in place: a captured step keeps reading the same tensor
        if rows is None:
            self.lengths.add_(step)
        else:
            self.lengths.index_add_(0, rows, torch.ones_like(rows) * step)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``, in that order (finished rows leave the batch)."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.lengths = self.lengths[rows]
        self._all = self._all[:len(rows)]


class _RowState:
    """A model's generation state, row by row: the KVCaches named in ``caches`` (the first one's lengths are
    the rows' lengths), tensors whose first axis is the row (``tensors``) and host-side lists (``host``)."""

    caches: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    host: tuple[str, ...] = ("n_host",)

    @property
    def lengths(self) -> torch.Tensor:
        return getattr(self, self.caches[0]).lengths

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``, in that order (rows that ended leave the batch)."""
        for name in self.caches:
            getattr(self, name).keep(rows)
        for name in self.tensors:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        at = rows.tolist()
        for name in self.host:
            setattr(self, name, [getattr(self, name)[i] for i in at])


class TokenCache(_RowState):
    """The BPE token model's generation state: its layers' keys and values, each row's length on the host."""

    caches = ("main",)

    def __init__(self, model, batch: int, capacity: int):
        p = next(model.parameters())
        m = model.main
        self.main = KVCache(len(m.layers), batch, m.layers[0].attn.n_heads, m.head_dim, capacity, device=p.device,
                            dtype=p.dtype)
        self.n_host = [0] * batch
        self.capacity = capacity


class ByteCache(_RowState):
    """The byte U-net's generation state for ``batch`` rows of up to ``capacity`` bytes:

    - ``byte``: the encoder's and the decoder's keys and values (one KVCache: the two stacks advance
      together), ``main``: the main network's (one position per chunk);
    - ``x`` [B, S], ``h`` [B, S, d], ``starts`` [B, S]: each row's bytes, encoder states and chunk starts
      (what a boundary strategy reads); ``z`` [B, 1, dm], ``up`` [B, 1, d]: the latest chunk's main-network
      output and its up-projection (what every byte until the next chunk adds);
    - ``noise`` [B, S] or None: the boundary strategy's uniform draws at each position (set by the caller;
      None: the strategy draws its own);
    - ``n_host``, ``chunks_host``: each row's length and chunk count, on the host (where a step reads how
      much of the caches to attend over)."""

    caches = ("byte", "main")
    tensors = ("x", "h", "starts", "z", "up", "noise")
    host = ("n_host", "chunks_host")

    def __init__(self, model, batch: int, capacity: int):
        p = next(model.parameters())
        dev, dt = p.device, p.dtype
        enc, main, dec = model.encoder, model.main, model.decoder
        n_byte = len(enc.layers) + len(dec.layers)
        self.byte = KVCache(n_byte, batch, model.cfg.n_heads, enc.head_dim, capacity, device=dev, dtype=dt,
                            window=getattr(model.cfg, "byte_window", None))
        self.main = KVCache(len(main.layers), batch, model.cfg.main_heads, main.head_dim, capacity, device=dev,
                            dtype=dt)
        self.encoder = self.byte.layers[:len(enc.layers)]
        self.decoder = self.byte.layers[len(enc.layers):]
        d, dm = model.cfg.d_model, model.cfg.main_width
        self.x = torch.zeros(batch, capacity, dtype=torch.long, device=dev)
        self.h = torch.zeros(batch, capacity, d, dtype=dt, device=dev)
        self.starts = torch.zeros(batch, capacity, dtype=torch.bool, device=dev)
        self.z = torch.zeros(batch, 1, dm, dtype=dt, device=dev)
        self.up = torch.zeros(batch, 1, d, dtype=dt, device=dev)
        self.noise: torch.Tensor | None = None
        self.n_host = [0] * batch
        self.chunks_host = [0] * batch
        self.capacity = capacity
