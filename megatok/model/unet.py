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

Generation reads a prompt with ``forward(..., cache={})`` and then one byte at a time with ``step``,
which runs the encoder and decoder on that byte and the main network only when it starts a chunk.

Every module runs on every call whatever the boundaries are, so ranks never diverge in the
modules they call (ZeRO needs that). The model knows nothing of DeepSpeed or of the data pipeline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatok.boundaries import build_strategy
from megatok.boundaries.base import Record, finalize_starts, forced_starts
from megatok.config import BoundaryConfig, ModelConfig
from megatok.model.blocks import Stack, ffn_hidden, init_matrices
from megatok.model.chunking import chunk_layout, downsample, ema_over_chunks, upsample
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

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                starts: torch.Tensor | None = None, cache: dict | None = None) -> Output:
        """x, targets: [B, T] ids (PAD where there is nothing). ``starts`` [B, T'] (T' <= T) overrides
        the strategy's first T' decisions (the strategy still runs), e.g. to hold boundaries fixed in a
        test, or the ones already taken while generating (megatok.generate). Not with ``targets``: the
        strategy's log-probabilities, gate and losses would still describe its own decisions.
        ``cache``: an empty dict, filled for :meth:`step` (generation, one sequence, no targets)."""
        if (starts is not None or cache is not None) and targets is not None:
            raise ValueError("starts and cache are for inference only; they cannot be combined with targets")
        if cache is not None:
            if x.shape[0] != 1 or self.training:
                raise ValueError("a generation cache holds one sequence, in eval mode")
            cache.update(encoder=[{} for _ in self.encoder.layers], main=[{} for _ in self.main.layers],
                         decoder=[{} for _ in self.decoder.layers])
        kv = cache if cache is not None else {}  # each stack's per-layer key/value caches, or None
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
        b = self.boundary(h, x, real, forced)
        forced = b.forced  # the strategy's (t = 0 when it was given None)
        if starts is not None:
            pinned = b.starts.clone()
            pinned[:, :starts.shape[1]] = starts
            b.starts = finalize_starts(pinned, real, forced)

        # K chunks a row (the last ones pads); the main network's row-wise layers skip the pads (rows).
        # Generation's cache keeps the main network's keys: no pad chunk may enter it.
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
            cache.update(x=x, h=h, starts=b.starts, z=z[:, -1:])
        logits = self.head(self.out_norm(y))
        out = Output(logits=logits, early_logits=early_logits, boundaries=b)
        if targets is not None:
            self._losses(out, x, targets)
        return out

    @torch.no_grad()
    def step(self, x_new: torch.Tensor, cache: dict) -> Output:
        """One more byte [1, 1] after ``forward(..., cache=cache)`` or earlier steps: its logits and
        early-exit logits [1, 1, V], and its boundary, decided by the strategy over the whole window as
        ``forward`` would (earlier decisions stay as taken). The encoder and decoder run on the new byte
        only, the main network only when it starts a chunk; their keys and values come from the cache.
        Equal to ``forward`` over the window with its starts pinned (up to float rounding)."""
        t = cache["x"].shape[1]
        x = torch.cat([cache["x"], x_new], 1)
        pos = torch.tensor([t], device=x.device)
        h_t = self.encoder(self.embed(x_new), pos, cache=cache["encoder"])
        h = torch.cat([cache["h"], h_t], 1)
        real = x != PAD
        b = self.boundary(h, x, real, forced_starts(x, real, SEP) if self.cfg.document_mask else None)
        forced = b.forced
        b.starts = torch.cat([cache["starts"], b.starts[:, -1:]], 1)
        if b.starts[0, -1]:
            z = self.main_norm(self.main(self.down_proj(h_t), pos, cache=cache["main"]))
            if b.get("smooth") is not None:
                p = b.smooth.masked_fill(forced, 1.0)[:, -1:, None].to(z.dtype)
                z = p * z + (1 - p) * cache["z"]
            cache["z"] = z
        up = self.up_proj(cache["z"])
        if b.gate is not None:
            up = up * b.gate[:, -1:, None].to(up.dtype)
        y = self.decoder(h_t + up, pos, cache=cache["decoder"])
        cache.update(x=x, h=h, starts=b.starts)
        return Output(logits=self.head(self.out_norm(y)), early_logits=self.early_head(self.early_norm(h_t)),
                      boundaries=b)

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
        k = self.boundary.samples if self.training else 1  # forward repeated the rows k times
        if k > 1:  # each sequence once: its samples' statistics averaged
            rows = {key: v.view(-1, k).mean(1) for key, v in rows.items()}
        out.rows = rows
        out.stats = {key: v.sum() for key, v in out.rows.items()}
