"""The BPE baseline: a plain causal transformer over sentencepiece token ids.

    ids [B, T] -> embed -> n_main_layers blocks (the main network's width and heads) -> norm -> next-token logits

It is built from the same blocks as megatok's main network and trained by the same loop, so the
only differences in a head-to-head are the ones being compared: a frozen BPE vocabulary against
learned chunks. Its statistics are in bytes, not tokens (see :func:`token_row_stats`), so its
bits per byte are the summed token NLL over the UTF-8 bytes of the text, comparable with megatok's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatok.boundaries.base import forced_starts
from megatok.config import ModelConfig
from megatok.model.blocks import Stack, ffn_hidden, init_matrices
from megatok.model.cache import TokenCache
from megatok.model.unet import Output


@torch.no_grad()
def token_row_stats(y: torch.Tensor, ce: torch.Tensor, byte_lengths: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """float64 [B] per key: ``nll`` (nats, over targets that stand for bytes: a control token such as
    the ``</s>`` document separator is trained on but not counted, as megatok leaves out SEP),
    ``targets`` (UTF-8 bytes those targets spell), ``tokens`` (their number) and ``positions``."""
    counted = byte_lengths[y] > 0
    return {"nll": (ce * counted).sum(1).double(), "targets": byte_lengths[y].sum(1).double(),
            "tokens": counted.sum(1).double(), "positions": (y != pad_id).sum(1).double()}


class TokenLM(nn.Module):
    """``byte_lengths`` [vocab] holds the bytes each id stands for (megatok.bpe.token_byte_lengths of
    every id; 0 for control ids and for the padding rows above the tokenizer's vocabulary). Without
    it (sizing on the meta device) the statistics count no bytes. ``sep_id`` (``</s>``, before every
    packed document) is where attention stops with ``cfg.document_mask``."""

    def __init__(self, cfg: ModelConfig, byte_lengths: torch.Tensor | None = None, pad_id: int = 0,
                 sep_id: int | None = None):
        super().__init__()
        self.cfg, self.pad_id, self.sep_id = cfg, pad_id, sep_id
        w, V = cfg.main_width, cfg.vocab_size
        lengths = torch.zeros(V, dtype=torch.long)
        if byte_lengths is not None:
            if len(byte_lengths) > V:
                raise ValueError(f"the tokenizer has {len(byte_lengths)} pieces but model.vocab_size is {V}")
            lengths[:len(byte_lengths)] = torch.as_tensor(byte_lengths, dtype=torch.long)
        self.register_buffer("byte_lengths", lengths, persistent=False)
        self.embed = nn.Embedding(V, w)
        self.main = Stack(cfg.n_main_layers, w, cfg.main_heads, ffn_hidden(w, cfg.ffn_mult, cfg.ffn_multiple_of),
                          eps=cfg.norm_eps, theta=cfg.rope_theta, checkpointing=cfg.activation_checkpointing)
        self.main_norm = nn.RMSNorm(w, eps=cfg.norm_eps)
        self.head = nn.Linear(w, V, bias=False)
        init_matrices(self, cfg.init_std, cfg.n_main_layers)

    def new_cache(self, batch: int, capacity: int) -> TokenCache:
        """Generation state for ``batch`` rows of up to ``capacity`` tokens (megatok.model.cache), filled by
        ``forward(..., cache=, cache_rows=)`` and advanced by :meth:`step`."""
        return TokenCache(self, batch, capacity)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, cache: TokenCache | None = None,
                cache_rows: torch.Tensor | None = None) -> Output:
        """``cache`` (eval mode, no targets): row i of x is a prompt (right-padded with pad_id) read into row
        ``cache_rows[i]`` of the cache (default: row i), for :meth:`step`."""
        B, T = x.shape
        if cache is not None:
            if targets is not None or self.training:
                raise ValueError("cache is for inference (eval mode, no targets)")
            cache_rows = torch.arange(B, device=x.device) if cache_rows is None else cache_rows
            cache.main.prefill(cache_rows)
        docs = None
        if self.cfg.document_mask:
            if self.sep_id is None:
                raise ValueError("model.document_mask needs the tokenizer's </s> id (sep_id)")
            docs = forced_starts(x, x != self.pad_id, self.sep_id).long().cumsum(1)
        h = self.main(self.embed(x), torch.arange(T, device=x.device), docs, None if cache is None else cache.main)
        if cache is not None:
            cache.main.lengths[cache_rows] = (x != self.pad_id).sum(1)
            n = (x != self.pad_id).sum(1).tolist()
            for row, length in zip(cache_rows.tolist(), n):
                cache.n_host[row] = length
        out = Output(logits=self.head(self.main_norm(h)), early_logits=None, boundaries=None)
        if targets is not None:
            ce = F.cross_entropy(out.logits.float().reshape(B * T, -1), targets.reshape(-1), ignore_index=self.pad_id,
                                 reduction="none").view(B, T)
            mask = targets != self.pad_id
            out.terms = {"lm_loss": (ce * mask).sum() / mask.sum().clamp(min=1)}
            out.loss, out.ce_full = out.terms["lm_loss"], ce
            out.rows = token_row_stats(targets, ce, self.byte_lengths, self.pad_id)
            out.stats = {k: v.sum() for k, v in out.rows.items()}
        return out

    @torch.no_grad()
    def step(self, x_new: torch.Tensor, cache: TokenCache, static: bool = False) -> Output:
        """One more token for every row of the cache, ``x_new`` [B]: its logits [B, 1, V], from the cached
        keys and values of the tokens before it. ``static``: fixed shapes, no host sync (a CUDA graph's)."""
        pos = cache.main.lengths.clone()[:, None]
        cache.main.extend(limit=None if static else max(cache.n_host) + 1)
        h = self.main(self.embed(x_new[:, None]), pos, cache=cache.main)
        if not static:
            cache.n_host = [i + 1 for i in cache.n_host]
        return Output(logits=self.head(self.main_norm(h)), early_logits=None, boundaries=None)
