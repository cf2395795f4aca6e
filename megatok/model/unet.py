"""The byte U-net: bytes -> encoder -> boundaries -> chunks -> main network -> bytes -> decoder.

    x [B, T] byte ids
      embed -> encoder (byte rate, causal; model.byte_window: sliding window)   h [B, T, d]
      boundary strategy                                       starts [B, T], chunk 0 at t = 0
      downsample: h at chunk starts                           [B, K, d_main]
      main network (chunk rate, causal; rotary on the byte position of each chunk start)
      [optional, when the strategy sets ``smooth``: EMA over chunks, z_j = P_j zhat_j + (1-P_j) z_{j-1}]
      upsample: byte t gets the latest chunk starting <= t, added to h_t
      decoder (byte rate, causal) -> next-byte logits
    early-exit head on h: predicts the next byte without the main network (reward + small loss)

With ``document_mask`` the packed documents of a window are independent: every SEP is a forced chunk
start, and the encoder, the main network and the decoder attend within a document only (chunks
inherit the document of their start), so no output in a document depends on anything before its SEP.

Generation reads a batch of prompts with ``forward(..., cache=model.new_cache(B, S))`` and then one byte
per row at a time with ``step``, which runs the encoder and decoder on that byte and the main network only
for the rows whose byte starts a chunk (megatok.model.cache: preallocated keys and values).

Every module runs on every call whatever the boundaries are, so ranks never diverge in the
modules they call (ZeRO needs that). The model knows nothing of DeepSpeed or of the data pipeline.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatok.boundaries import build_strategy
from megatok.boundaries.base import Boundaries, Record, finalize_starts, forced_starts, given_noise
from megatok.config import BoundaryConfig, ModelConfig
from megatok.model.blocks import Stack, ffn_hidden, init_matrices
from megatok.model.cache import ByteCache
from megatok.model.chunking import chunk_layout, downsample, ema_over_chunks, pack, packed_length, upsample
from megatok.rl import masked_mean
from megatok.stats import row_stats
from megatok.vocab import PAD, SEP, VOCAB_SIZE


class Output(Record):
    """``logits`` [B, T, V] next-byte logits; ``early_logits`` [B, T, V] the early-exit head;
    ``boundaries``; and, when targets are given: ``loss`` (what backward takes), ``terms`` (lm_loss,
    policy_loss, ...), ``rows`` (detached per-row sums [B], see megatok.stats.row_stats), ``stats``
    (their totals), ``ce_full`` [B, T] per-byte loss in nats (0 at padding), ``ce_early`` the same
    for the early-exit head. (megatok.model.token_lm fills the same fields, with no boundaries.)"""

    def __init__(self, logits, early_logits, boundaries, loss=None, terms=None, rows=None, stats=None,
                 ce_full=None, ce_early=None):
        super().__init__(logits=logits, early_logits=early_logits, boundaries=boundaries, loss=loss,
                         terms=terms or {}, rows=rows or {}, stats=stats or {}, ce_full=ce_full, ce_early=ce_early)


class ByteUNet(nn.Module):
    def __init__(self, cfg: ModelConfig, boundary: BoundaryConfig):
        super().__init__()
        self.cfg = cfg
        #: Chunks per byte the main network has room for (model.chunk_capacity; megatok.model.chunking):
        #: a row with more starts joins its last ones to the chunk before them (the math changes for that
        #: row). With static_chunks the length is the capacity's, with no device-to-host sync per forward.
        #: None: room for the batch's largest count, rounded up to one of a few sizes.
        self.chunk_capacity, self.static_chunks = cfg.chunk_capacity, cfg.static_chunks
        #: model.pack_chunks: the slack of the packed layout (megatok.model.chunking.pack), or None
        self.pack_slack = cfg.pack_chunks
        d, dm = cfg.d_model, cfg.main_width

        def stack(n, width, heads, window=None):
            return Stack(n, width, heads, ffn_hidden(width, cfg.ffn_mult, cfg.ffn_multiple_of), eps=cfg.norm_eps,
                         theta=cfg.rope_theta, checkpointing=cfg.activation_checkpointing, window=window)

        self.embed = nn.Embedding(VOCAB_SIZE, d)
        self.encoder = stack(cfg.n_encoder_layers, d, cfg.n_heads, cfg.byte_window)
        self.boundary = build_strategy(boundary.strategy, d_model=d, target_rate=boundary.target_rate,
                                       options=boundary.options)
        self.down_proj = nn.Linear(d, dm, bias=False) if dm != d else nn.Identity()
        self.main = stack(cfg.n_main_layers, dm, cfg.main_heads)
        self.main_norm = nn.RMSNorm(dm, eps=cfg.norm_eps)
        self.up_proj = nn.Linear(dm, d, bias=False) if dm != d else nn.Identity()
        self.decoder = stack(cfg.n_decoder_layers, d, cfg.n_heads, cfg.byte_window)
        self.out_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, VOCAB_SIZE, bias=False)
        self.early_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.early_head = nn.Linear(d, VOCAB_SIZE, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        n_layers = self.cfg.n_encoder_layers + self.cfg.n_main_layers + self.cfg.n_decoder_layers
        init_matrices(self, self.cfg.init_std, n_layers, skip="boundary.")  # strategies initialise their own

    def new_cache(self, batch: int, capacity: int) -> ByteCache:
        """Generation state for ``batch`` rows of up to ``capacity`` bytes (megatok.model.cache), filled by
        ``forward(..., cache=, cache_rows=)`` and advanced by :meth:`step`."""
        return ByteCache(self, batch, capacity)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, starts: torch.Tensor | None = None,
                cache: ByteCache | None = None, cache_rows: torch.Tensor | None = None,
                decided: torch.Tensor | None = None) -> Output:
        """x, targets: [B, T] ids (PAD where there is nothing). ``starts`` [B, T'] (T' <= T) overrides
        the strategy's first T' decisions of each row (``decided`` [B]: of row b its first decided[b] only)
        (the strategy still runs), e.g. to hold boundaries fixed in a test, or the ones already taken while
        generating (megatok.generate). Not with ``targets``: the strategy's log-probabilities, gate and
        losses would still describe its own decisions. ``cache`` (eval mode, no targets): row i of x is a
        prompt (right-padded) read into row ``cache_rows[i]`` of the cache (default: row i), for
        :meth:`step`; the strategy draws from ``cache.noise`` there when it is set."""
        if (starts is not None or cache is not None) and targets is not None:
            raise ValueError("starts and cache are for inference only; they cannot be combined with targets")
        if cache is not None:
            if self.training:
                raise ValueError("a generation cache is filled in eval mode")
            if cache_rows is None:
                cache_rows = torch.arange(x.shape[0], device=x.device)
            cache.byte.prefill(cache_rows)
            cache.main.prefill(cache_rows)
        kv = {} if cache is None else {"encoder": cache.encoder, "main": cache.main, "decoder": cache.decoder}
        B, T = x.shape
        real = x != PAD
        positions = torch.arange(T, device=x.device)
        forced = forced_starts(x, real, SEP) if self.cfg.document_mask else None  # None: t = 0 only
        docs = None if forced is None else forced.long().cumsum(1)  # document of each byte

        h = self.encoder(self.embed(x), positions, docs, kv.get("encoder"))
        early_logits = self.early_head(self.early_norm(h))
        k = self.boundary.samples if self.training and targets is not None else 1
        if k > 1:  # k boundary samples of every sequence, side by side; the encoder and early head ran once
            x, targets, real, h, early_logits = (v.repeat_interleave(k, 0) for v in (x, targets, real, h, early_logits))
            forced = None if forced is None else forced.repeat_interleave(k, 0)
            docs = None if docs is None else docs.repeat_interleave(k, 0)
        noise = None if cache is None or cache.noise is None else given_noise(cache.noise[cache_rows])
        with noise or contextlib.nullcontext():
            b = self.boundary(h, x, real, forced)
        forced = b.forced  # the strategy's (t = 0 when it was given None)
        if starts is not None:
            pinned = b.starts.clone()
            if decided is None:
                pinned[:, :starts.shape[1]] = starts
            else:
                keep = torch.arange(starts.shape[1], device=x.device)[None, :] < decided[:, None]
                pinned[:, :starts.shape[1]] = torch.where(keep, starts, pinned[:, :starts.shape[1]])
            b.starts = finalize_starts(pinned, real, forced)

        if self.pack_slack is not None and cache is None:
            up = self._packed_main(h, b, forced, docs)
        else:
            # K chunks a row (the last ones pads); the main network's row-wise layers skip the pads (rows).
            # Generation's cache keeps the main network's keys: every chunk enters it (the pads past a row's
            # count stay out of its length).
            K, rows = (None, None) if cache is not None else chunk_layout(b.starts, self.chunk_capacity,
                                                                         static=self.static_chunks)
            chunks, chunk_pos, _ = downsample(h, b.starts, K)
            chunk_docs = None if docs is None else docs.gather(1, chunk_pos)
            z = self.main_norm(self.main(self.down_proj(chunks), chunk_pos, chunk_docs, kv.get("main"), rows=rows))
            if b.get("smooth") is not None:  # generic hook: the strategy's P at each chunk's start
                z = ema_over_chunks(z, b.smooth.masked_fill(forced, 1.0).gather(1, chunk_pos))  # P = 1: a fresh start
            up = upsample(self.up_proj(z), b.starts)  # project per chunk, before copying to every byte
        if b.gate is not None:
            up = up * b.gate[..., None].to(up.dtype)
        y = self.decoder(h + up, positions, docs, kv.get("decoder"))
        if cache is not None:
            self._fill(cache, cache_rows, x, real, h, b.starts, z)
        logits = self.head(self.out_norm(y))
        out = Output(logits=logits, early_logits=early_logits, boundaries=b)
        if targets is not None:
            self._losses(out, x, targets)
        return out

    def _packed_main(self, h: torch.Tensor, b: Boundaries, forced: torch.Tensor, docs) -> torch.Tensor:
        """The main network over the micro-batch's chunks packed into one sequence of a fixed length
        (megatok.model.chunking.pack; model.pack_chunks): the upsampled chunk output at every byte [B, T, d].
        Starts past the length are dropped: the strategy is told the decisions taken (``taken``)."""
        B, T, D = h.shape
        lay = pack(b.starts, forced, packed_length(B, T, self.boundary.target_rate, self.pack_slack), docs)
        self.boundary.taken(b, lay.starts)
        b.dropped = lay.dropped
        chunks = h.reshape(B * T, D).index_select(0, lay.src)[None]
        z = self.main_norm(self.main(self.down_proj(chunks), lay.positions[None], lay.segments[None]))
        if b.get("smooth") is not None:
            z = ema_over_chunks(z, b.smooth.masked_fill(forced, 1.0).reshape(-1).gather(0, lay.src)[None])
        return self.up_proj(z)[0].index_select(0, lay.chunk_of).view(B, T, -1)

    def _fill(self, cache: ByteCache, rows: torch.Tensor, x, real, h, starts, z) -> None:
        """The rest of a prompt's state, after its stacks wrote their keys and values."""
        T = x.shape[1]
        n, counts = real.sum(1), starts.sum(1)
        cache.byte.lengths[rows] = n
        cache.main.lengths[rows] = counts
        cache.x[rows, :T], cache.h[rows, :T], cache.starts[rows, :T] = x, h.to(cache.h.dtype), starts
        last = z.gather(1, (counts - 1)[:, None, None].expand(-1, 1, z.shape[-1]))  # the row's latest chunk
        cache.z[rows] = last.to(cache.z.dtype)
        cache.up[rows] = self.up_proj(last).to(cache.up.dtype)
        for row, length, count in zip(rows.tolist(), n.tolist(), counts.tolist()):
            cache.n_host[row], cache.chunks_host[row] = length, count

    @torch.no_grad()
    def step(self, x_new: torch.Tensor, cache: ByteCache, static: bool = False) -> Output:
        """One more byte for every row of the cache, ``x_new`` [B]: its next-byte logits [B, 1, V] and its
        boundary (``boundaries.starts`` [B, 1]), decided by the strategy as ``forward`` would decide it over
        the row's window, earlier decisions held (over the last reach + 2 positions where the strategy
        declares a ``reach``). The encoder and decoder run on the new byte only; the main network only for
        the rows whose byte starts a chunk; every layer attends over its cached keys and values. Equal to
        ``forward`` over each row's window with its starts pinned (up to float rounding).

        ``static``: fixed shapes and no host sync (what a CUDA graph captures): the caches are read over
        their whole capacity and the main network runs on every row, keeping the result of the rows whose
        byte starts a chunk. The host-side lengths are then not kept (``n_host``, ``chunks_host``)."""
        ar = cache.byte._all
        n = cache.byte.lengths.clone()  # the new byte's position in each row
        cache.byte.extend(limit=None if static else max(cache.n_host) + 1)
        pos = n[:, None]
        cache.x[ar, n] = x_new
        h_t = self.encoder(self.embed(x_new[:, None]), pos, cache=cache.encoder)  # [B, 1, d]
        cache.h[ar, n] = h_t[:, 0].to(cache.h.dtype)
        b = self._decide(cache, n, static)
        start = b.starts
        cache.starts[ar, n] = start
        self._main_step(cache, h_t, n, start, b.get("smooth"), static)
        up = cache.up
        if b.gate is not None:
            up = up * b.gate[:, None, None].to(up.dtype)
        y = self.decoder(h_t + up, pos, cache=cache.decoder)
        if not static:
            cache.n_host = [i + 1 for i in cache.n_host]
        return Output(logits=self.head(self.out_norm(y)), early_logits=None,
                      boundaries=Boundaries(starts=start[:, None]))

    def _decide(self, cache: ByteCache, n: torch.Tensor, static: bool) -> Boundaries:
        """The strategy's decision at each row's new byte (position n): starts [B] and, where the strategy
        has them, gate and smooth [B] there."""
        reach = self.boundary.reach
        if reach is not None:  # the last reach + 2 positions (the first one only stands for "before")
            p = n[:, None] + torch.arange(-reach - 1, 1, device=n.device)  # [B, reach + 2]
            valid = p >= 0
            at = p.clamp(min=0)
            x = cache.x.gather(1, at).masked_fill(~valid, PAD)
            h = cache.h.gather(1, at[..., None].expand(-1, -1, cache.h.shape[-1]))
            forced = p == 0
            noise = None if cache.noise is None else cache.noise.gather(1, at)
            col = None
        else:  # the whole window, each row up to its new byte
            L = cache.capacity if static else max(cache.n_host) + 1
            j = torch.arange(L, device=n.device)
            valid = j[None, :] <= n[:, None]
            x, h = cache.x[:, :L].masked_fill(~valid, PAD), cache.h[:, :L]
            forced = forced_starts(x, valid, None)
            noise = cache.noise
            col = n[:, None]
        if self.cfg.document_mask:
            forced = forced | ((x == SEP) & valid)
        with given_noise(noise) if noise is not None else contextlib.nullcontext():
            b = self.boundary(h, x, valid, forced)

        def at_new(t):
            return None if t is None else (t[:, -1] if col is None else t.gather(1, col)[:, 0])

        smooth = b.get("smooth")
        if smooth is not None:
            smooth = smooth.masked_fill(b.forced, 1.0)
        return Boundaries(starts=at_new(b.starts), gate=at_new(b.gate), smooth=at_new(smooth))

    def _main_step(self, cache: ByteCache, h_t, n, start, smooth, static: bool) -> None:
        """The main network on the new bytes that start a chunk (static: on every row, kept where one does):
        the chunk's output (after the strategy's smoothing) becomes the row's ``z`` and ``up``."""
        if static:
            rows = None
            cache.main.extend(grow=start.long())
        else:
            picked = start.nonzero().squeeze(1)
            host = picked.tolist()
            if not host:
                return
            rows = None if len(host) == len(start) else picked
            chunks = cache.chunks_host
            cache.main.extend(rows, limit=max(chunks[i] for i in host) + 1)
            for i in host:
                chunks[i] += 1
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        z = self.main_norm(self.main(self.down_proj(pick(h_t)), pick(n)[:, None], cache=cache.main))
        if smooth is not None:
            p = pick(smooth)[:, None, None].to(z.dtype)
            z = p * z + (1 - p) * pick(cache.z)
        up = self.up_proj(z)
        if static:
            keep = start[:, None, None]
            cache.z.copy_(torch.where(keep, z.to(cache.z.dtype), cache.z))
            cache.up.copy_(torch.where(keep, up.to(cache.up.dtype), cache.up))
        elif rows is None:
            cache.z.copy_(z)
            cache.up.copy_(up)
        else:
            cache.z[rows], cache.up[rows] = z.to(cache.z.dtype), up.to(cache.up.dtype)

    def _losses(self, out: Output, x: torch.Tensor, targets: torch.Tensor) -> None:
        B, T = targets.shape
        tmask = targets != PAD

        def per_byte_ce(logits):
            ce = F.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(-1), ignore_index=PAD,
                                 reduction="none")
            return ce.view(B, T)

        ce_full, ce_early = per_byte_ce(out.logits), per_byte_ce(out.early_logits)
        w = self.cfg.early_exit_weight
        terms = {"lm_loss": (1 - w) * masked_mean(ce_full, tmask) + w * masked_mean(ce_early, tmask)}
        terms.update(self.boundary.loss(out.boundaries, ce_full, ce_early, tmask))
        out.terms, out.ce_full, out.ce_early = terms, ce_full, ce_early
        out.loss = sum(terms.values())
        b = out.boundaries
        rows = {**row_stats(x, targets, b.starts, ce_full, ce_early, probs=b.probs), **b.extra.get("rows", {})}
        if b.get("dropped") is not None:  # model.pack_chunks: starts the packed length had no room for
            rows["dropped_starts"] = b.dropped.to(ce_full.dtype)
        k = self.boundary.samples if self.training else 1  # forward repeated the rows k times
        if k > 1:  # each sequence once: its samples' statistics averaged
            rows = {key: v.view(-1, k).mean(1) for key, v in rows.items()}
        out.rows = rows
        out.stats = {key: v.sum() for key, v in out.rows.items()}
