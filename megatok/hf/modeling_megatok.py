"""megatok's byte U-net for transformers: written by megatok-export next to the weights, loaded with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``; torch and transformers only.

    ids [B, T] -> embed -> encoder (byte rate)                               h [B, T, d]
       -> boundaries (the trained strategy, under config.boundary_rule)      starts [B, T], one at t = 0
       -> the states at chunk starts -> main network (chunk rate)            z [B, K, d_main]
       -> byte t gets its chunk's z, added to h -> decoder -> next-byte logits [B, T, 258]

Ids 0-255 are bytes, 256 the separator megatok puts before every document (bos and eos), 257 padding.
``model(ids).logits`` are megatok's next-byte logits for those ids under the same boundary rule
(``megatok.load(dir).module``); padding on the left (``attention_mask``) is moved to the right before
the model reads a row, so each row is read as it is alone. ``generate`` keeps a cache (every layer's keys
and values, the bytes, states and chunk starts so far) and decides each new byte's boundary as it
arrives, as the forward pass over the whole text decides it, up to the training window
(``config.max_position_embeddings`` bytes a row).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megatok import MegatokByteConfig

SEP, PAD = 256, 257
SEPARATORS = b"\t\n\x0b\x0c\r !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
STRATEGIES = ("policy", "gumbel", "hnet", "fixed", "whitespace")


# ------------------------------------------------------------------------------------------ blocks

def rotary(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin for integer positions [T] or [B, T], shaped [(B,) T, 1, 1, head_dim / 2]."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv
    return angles.cos()[..., None, None, :], angles.sin()[..., None, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin, mask, kv=None):
        """``mask``: bool [B or 1, 1, T, S] (True: may attend) or None (causal). ``kv(k, v)``: a cache's
        hook, which stores this call's keys and values and returns the ones to attend over."""
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, D // self.heads)
        q, k = rotate(qkv[:, :, :2], cos, sin).transpose(1, 3).unbind(2)
        v = qkv[:, :, 2].transpose(1, 2)
        if kv is not None:
            k, v = kv(k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d, eps=eps)
        self.attn = Attention(d, heads)
        self.mlp_norm = nn.RMSNorm(d, eps=eps)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x, cos, sin, mask, kv=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv)
        return x + self.mlp(self.mlp_norm(x))


class Stack(nn.Module):
    def __init__(self, n: int, d: int, heads: int, hidden: int, eps: float, theta: float):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, heads, hidden, eps) for _ in range(n))
        self.head_dim, self.theta = d // heads, theta

    def forward(self, x, positions, mask, hooks=None):
        cos, sin = rotary(positions, self.head_dim, self.theta)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, None if hooks is None else hooks[i])
        return x


def attend_mask(query_pos, key_pos, query_doc=None, key_doc=None, window=None):
    """bool [B, 1, Tq, Tk]: a query may see a key at or before it, in its document, within ``window``."""
    lag = query_pos[..., :, None] - key_pos[..., None, :]
    ok = lag >= 0
    if window is not None:
        ok = ok & (lag < window)
    if query_doc is not None:
        ok = ok & (query_doc[..., :, None] == key_doc[..., None, :])
    return ok[:, None] if ok.dim() == 3 else ok[None, None]


# -------------------------------------------------------------------------------------- boundaries

def since_forced(forced: torch.Tensor) -> torch.Tensor:
    """long [B, T]: t minus the position of the latest forced start at or before t."""
    t = torch.arange(forced.shape[1], device=forced.device)
    return t - torch.where(forced, t, torch.zeros_like(t)).cummax(1).values


def window_seed(seed: int, text: bytes, window: int = 0) -> int:
    """megatok-evaluate's seed of a document window's sampled boundaries (megatok.eval.bpb.window_seed)."""
    digest = hashlib.blake2b(text, digest_size=8, key=f"{seed}:{window}".encode()).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Boundary(nn.Module):
    """The trained strategy's decisions, under the threshold rule (noise None) or from given draws
    ``noise`` [B, T] in [0, 1). Holds the strategy's parameters under megatok's names."""

    def __init__(self, cfg: MegatokByteConfig):
        super().__init__()
        if cfg.strategy not in STRATEGIES:
            raise ValueError(f"strategy {cfg.strategy!r} has no transformers export (exported: {', '.join(STRATEGIES)})")
        self.kind, self.rate, self.o = cfg.strategy, cfg.target_rate, cfg.strategy_options
        d = cfg.d_model
        if self.kind in ("policy", "gumbel"):
            self.head = nn.Linear(d, 1)
        if self.kind == "policy" and self.o.get("window", 1) > 1:
            self.window_head = nn.Linear(d, self.o["window"] - 1)
        if self.kind == "hnet":
            self.wq = nn.Linear(d, d, bias=False)
            self.wk = nn.Linear(d, d, bias=False)
        # decisions read positions t - reach .. t only; None: the whole window (generation reads all of it)
        self.reach = {"policy": self.o.get("lag", 0) if self.o.get("window", 1) == 1 else None, "gumbel": 0,
                      "hnet": 1, "whitespace": 1, "fixed": None}[self.kind]

    def forward(self, h, x, real, forced, noise=None):
        """(starts [B, T] bool, smooth [B, T] or None: H-Net's EMA coefficient at each byte)."""
        smooth = None
        if self.kind == "policy":
            lag, cap = self.o.get("lag", 0), self.o.get("logit_cap", 6.0)
            if lag:
                h = F.pad(h, (0, 0, lag, 0))[:, :h.shape[1]] * (since_forced(forced) >= lag)[..., None].to(h.dtype)
            if self.o.get("window", 1) > 1:
                starts = self._draw_window(h, real, forced, noise, cap)
            else:
                p = torch.sigmoid(cap * torch.tanh(self.head(h).squeeze(-1).float() / cap))
                starts = (noise < p) if noise is not None else (p > 0.5)
        elif self.kind == "gumbel":
            logits = self.head(h).squeeze(-1).float()
            if noise is None:
                starts = torch.sigmoid(logits) > 0.5
            else:
                u = noise.clamp(1e-6, 1 - 1e-6)
                starts = torch.sigmoid((logits + torch.log(u) - torch.log1p(-u)) / self.o.get("temperature", 0.5)) > 0.5
        elif self.kind == "hnet":
            q, k = self.wq(h).float(), self.wk(h).float()
            cos = F.cosine_similarity(q[:, :-1], k[:, 1:], dim=-1, eps=1e-6)
            p = F.pad(((1 - cos) / 2).clamp(0, 1), (1, 0), value=1.0).masked_fill(forced, 1.0)
            starts = p > 0.5
            smooth = p if self.o.get("smoothing", True) else None
        elif self.kind == "fixed":
            starts = since_forced(forced) % max(1, round(1 / self.rate)) == 0
        else:
            starts = self._whitespace(x)
        starts = (starts & real) | (forced & real)
        starts[:, 0] = True
        return starts, smooth

    def _whitespace(self, x):
        table = torch.zeros(258, dtype=torch.bool, device=x.device)
        table[list(SEPARATORS)] = True
        table[SEP] = True
        sep = table[x]
        prev, cur = x[:, :-1], x[:, 1:]
        if self.o.get("position", "after") == "at":
            s = sep[:, 1:]
        else:
            s = sep[:, :-1] & ~((cur >= 0x80) & (cur < 0xC0))
        if self.o.get("merge_space_runs", True):
            s = s & ~((cur == prev) & ((cur == 0x20) | (cur == 0x09)))
        return F.pad(s, (1, 0), value=True)

    def window_decision(self, base, weights, previous, noise, cap):
        """The window policy's decision at one position: base [B], weights and previous [B, w - 1]."""
        p = torch.sigmoid(cap * torch.tanh((base + (weights * previous).sum(-1)) / cap))
        return (noise < p) if noise is not None else (p > 0.5)

    def _draw_window(self, h, real, forced, noise, cap):
        """Each decision reads the w - 1 before it (0 before the row and before the latest forced start)."""
        base, weights = self.head(h).squeeze(-1).float(), self.window_head(h).float()
        B, T = base.shape
        starts = torch.zeros(B, T, dtype=torch.bool, device=h.device)
        prev = torch.zeros(B, weights.shape[-1], device=h.device)
        for t in range(T):
            prev = prev * ~forced[:, t, None]
            b = self.window_decision(base[:, t], weights[:, t], prev, None if noise is None else noise[:, t], cap)
            b = (b | forced[:, t]) & real[:, t]
            starts[:, t] = b
            prev = torch.cat([b.float()[:, None], prev[:, :-1]], 1)
        return starts


# ------------------------------------------------------------------------------------------ cache

class ByteCache:
    """What generation keeps per row: ``n`` bytes read and ``c`` chunks, their ids, states, starts and
    documents, every layer's keys and values (byte layers by byte position, main layers by chunk), the
    latest chunk's output ``z`` and its projection ``up``, and the boundary draws (sample rule)."""

    def __init__(self, model: "MegatokByteForCausalLM", B: int, device, dtype):
        cfg, C = model.config, model.config.max_position_embeddings
        self.capacity = C
        self.n = torch.zeros(B, dtype=torch.long, device=device)
        self.c = torch.zeros(B, dtype=torch.long, device=device)
        self.x = torch.full((B, C), PAD, dtype=torch.long, device=device)
        self.h = torch.zeros(B, C, cfg.d_model, dtype=dtype, device=device)
        self.starts = torch.zeros(B, C, dtype=torch.bool, device=device)
        self.docs = torch.zeros(B, C, dtype=torch.long, device=device)
        self.chunk_docs = torch.zeros(B, C, dtype=torch.long, device=device)
        self.z = torch.zeros(B, 1, cfg.main_width, dtype=dtype, device=device)
        self.up = torch.zeros(B, 1, cfg.d_model, dtype=dtype, device=device)
        self.noise = None

        def layers(n, d, heads):
            return [[torch.zeros(B, heads, C, d // heads, dtype=dtype, device=device) for _ in range(2)]
                    for _ in range(n)]
        self.kv = {"encoder": layers(cfg.n_encoder_layers, cfg.d_model, cfg.n_heads),
                   "main": layers(cfg.n_main_layers, cfg.main_width, cfg.main_heads),
                   "decoder": layers(cfg.n_decoder_layers, cfg.d_model, cfg.n_heads)}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.n.max())

    def hooks(self, stack: str, at: torch.Tensor | None):
        """Per layer: store keys and values (a prompt's: from column 0; a step's: at column ``at`` [B] of each
        row) and attend over the prompt's own (prompt) or the whole cache (step)."""
        def hook(store):
            def kv(k, v):
                if at is None:
                    T = k.shape[2]
                    store[0][:, :, :T], store[1][:, :, :T] = k, v
                    return k, v
                rows = torch.arange(k.shape[0], device=k.device)
                store[0][rows, :, at], store[1][rows, :, at] = k[:, :, 0], v[:, :, 0]
                return store[0], store[1]
            return kv
        return [hook(s) for s in self.kv[stack]]


# ------------------------------------------------------------------------------------------ model

class MegatokBytePreTrainedModel(PreTrainedModel):
    config_class = MegatokByteConfig
    base_model_prefix = "megatok"
    # the policy's latch and its moving average (training state), its value head (a training baseline)
    _keys_to_ignore_on_load_unexpected = [r"boundary\.(started|gap_ema)$", r"boundary\.value_head\."]

    def _init_weights(self, module):  # every weight comes from the export
        pass


class MegatokByteForCausalLM(MegatokBytePreTrainedModel, GenerationMixin):
    def __init__(self, config: MegatokByteConfig):
        super().__init__(config)
        c, d, dm = config, config.d_model, config.main_width
        self.embed = nn.Embedding(config.vocab_size, d)
        self.encoder = Stack(c.n_encoder_layers, d, c.n_heads, c.ffn_hidden, c.norm_eps, c.rope_theta)
        self.boundary = Boundary(config)
        self.down_proj = nn.Linear(d, dm, bias=False) if dm != d else nn.Identity()
        self.main = Stack(c.n_main_layers, dm, c.main_heads, c.main_ffn_hidden, c.norm_eps, c.rope_theta)
        self.main_norm = nn.RMSNorm(dm, eps=c.norm_eps)
        self.up_proj = nn.Linear(dm, d, bias=False) if dm != d else nn.Identity()
        self.decoder = Stack(c.n_decoder_layers, d, c.n_heads, c.ffn_hidden, c.norm_eps, c.rope_theta)
        self.out_norm = nn.RMSNorm(d, eps=c.norm_eps)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        self.early_norm = nn.RMSNorm(d, eps=c.norm_eps)
        self.early_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own cache (ByteCache), made in forward

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    # ------------------------------------------------------------------ helpers

    def _byte_mask(self, positions, docs, T):
        window = self.config.byte_window if self.config.byte_window and self.config.byte_window < T else None
        if docs is None and window is None:
            return None
        return attend_mask(positions, positions, docs, docs, window)

    def _noise(self, x, real, length):
        """The sample rule's draws [B, length]: row r from a generator seeded by boundary_seed and the row's
        bytes (megatok-evaluate's seed for a one-window document), drawn over max(length, the window)."""
        n = max(length, self.config.max_position_embeddings)
        rows = []
        for ids, ok in zip(x.tolist(), real.tolist()):
            text = bytes(i for i, r in zip(ids, ok) if r and i < 256)
            g = torch.Generator().manual_seed(window_seed(self.config.boundary_seed, text))
            rows.append(torch.rand(n, generator=g)[:length])
        return torch.stack(rows).to(x.device)

    @staticmethod
    def _compact(input_ids, attention_mask):
        """Each row's real ids moved to its front (stable), PAD after: (ids, real, order) or None when
        already so."""
        if attention_mask is None:
            return None
        keep = attention_mask.bool()
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        real = keep.gather(1, order)
        ids = input_ids.gather(1, order).masked_fill(~real, PAD)
        return ids, real, order

    # ------------------------------------------------------------------ forward

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None, labels=None,
                return_dict=True, **kwargs):
        if past_key_values is not None and input_ids.shape[1] == 1 and past_key_values.get_seq_length() > 0:
            logits = self._step(input_ids[:, 0], past_key_values)
            return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)
        packed = self._compact(input_ids, attention_mask)
        if packed is None:
            x, real, order = input_ids, input_ids != PAD, None
        else:
            x, real, order = packed
        cache = None
        if use_cache:
            cache = ByteCache(self, x.shape[0], x.device, self.embed.weight.dtype)
            if x.shape[1] > cache.capacity:
                raise ValueError(f"a prompt of {x.shape[1]} ids is past the training window "
                                 f"({cache.capacity}, config.max_position_embeddings)")
        logits = self._forward(x, real, cache)
        if order is not None:
            logits = torch.empty_like(logits).scatter_(1, order[..., None].expand_as(logits), logits)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def _forward(self, x, real, cache=None):
        cfg = self.config
        B, T = x.shape
        positions = torch.arange(T, device=x.device)
        forced = torch.zeros_like(real)
        if cfg.document_mask:
            forced = (x == SEP) & real
        forced[:, 0] = True
        docs = forced.long().cumsum(1) if cfg.document_mask else None
        h = self.encoder(self.embed(x), positions, self._byte_mask(positions, docs, T),
                         None if cache is None else cache.hooks("encoder", None))
        noise = None
        if cfg.boundary_rule == "sample":
            noise = self._noise(x, real, T)
            if cache is not None:
                cache.noise = self._noise(x, real, cache.capacity)
        starts, smooth = self.boundary(h, x, real, forced, noise)
        counts = starts.sum(1)
        K = int(counts.max())
        if cfg.chunk_capacity is not None and cache is None:  # megatok.model.chunking.chunk_slots
            K = min(K, T, _bucket(math.ceil(cfg.chunk_capacity * T)))
        running = starts.long().cumsum(1)
        k = torch.arange(1, K + 1, device=x.device).expand(B, K).contiguous()
        chunk_pos = torch.searchsorted(running, k).clamp_(max=T - 1)
        chunks = h.gather(1, chunk_pos[..., None].expand(B, K, h.shape[-1]))
        chunk_docs = None if docs is None else docs.gather(1, chunk_pos)
        idx = torch.arange(K, device=x.device)
        mask = attend_mask(idx, idx, chunk_docs, chunk_docs) if chunk_docs is not None else None
        z = self.main_norm(self.main(self.down_proj(chunks), chunk_pos, mask,
                                     None if cache is None else cache.hooks("main", None)))
        if smooth is not None:
            z = _ema(z, smooth.gather(1, chunk_pos))
        up = self.up_proj(z)
        up_bytes = up.gather(1, (running - 1).clamp(max=K - 1)[..., None].expand(-1, -1, up.shape[-1]))
        y = self.decoder(h + up_bytes, positions, self._byte_mask(positions, docs, T),
                         None if cache is None else cache.hooks("decoder", None))
        if cache is not None:
            n, c = real.sum(1), counts
            cache.n.copy_(n)
            cache.c.copy_(c)
            cache.x[:, :T], cache.h[:, :T], cache.starts[:, :T] = x, h, starts
            cache.docs[:, :T] = 0 if docs is None else docs
            if chunk_docs is not None:
                cache.chunk_docs[:, :K] = chunk_docs
            last = (c - 1)[:, None, None]
            cache.z.copy_(z.gather(1, last.expand(-1, 1, z.shape[-1])))
            cache.up.copy_(up.gather(1, last.expand(-1, 1, up.shape[-1])))
        return self.head(self.out_norm(y))

    @torch.no_grad()
    def _step(self, new: torch.Tensor, cache: ByteCache) -> torch.Tensor:
        """The next-byte logits [B, 1, V] after one more byte per row, ``new`` [B]."""
        cfg = self.config
        n = cache.n.clone()
        if int(n.max()) >= cache.capacity:
            raise ValueError(f"generation past the training window ({cache.capacity} bytes a row, "
                             f"config.max_position_embeddings) is not supported here; megatok.load(...).generate "
                             f"slides the window")
        B, rows = new.shape[0], torch.arange(new.shape[0], device=new.device)
        cache.x[rows, n] = new
        if cfg.document_mask:
            cache.docs[rows, n] = cache.docs[rows, (n - 1).clamp(min=0)] + (new == SEP).long()
        pos = n[:, None]
        doc = cache.docs[rows, n][:, None] if cfg.document_mask else None
        key_pos = torch.arange(cache.capacity, device=new.device).expand(B, -1)

        def byte_mask():
            window = cfg.byte_window
            return attend_mask(pos, key_pos, doc, cache.docs if doc is not None else None, window)

        h_t = self.encoder(self.embed(new[:, None]), pos, byte_mask(), cache.hooks("encoder", n))
        cache.h[rows, n] = h_t[:, 0]
        start, smooth = self._decide(cache, n)
        cache.starts[rows, n] = start
        c = cache.c
        if cfg.document_mask:
            cache.chunk_docs[rows, c] = cache.docs[rows, n]
        chunk_idx = torch.arange(cache.capacity, device=new.device).expand(B, -1)
        cmask = attend_mask(c[:, None], chunk_idx, cache.chunk_docs[rows, c][:, None] if cfg.document_mask else None,
                            cache.chunk_docs if cfg.document_mask else None)
        z = self.main_norm(self.main(self.down_proj(h_t), pos, cmask, cache.hooks("main", c)))
        if smooth is not None:
            p = smooth[:, None, None].to(z.dtype)
            z = p * z + (1 - p) * cache.z
        keep = start[:, None, None]
        cache.z.copy_(torch.where(keep, z, cache.z))
        cache.up.copy_(torch.where(keep, self.up_proj(z), cache.up))
        cache.c += start.long()
        y = self.decoder(h_t + cache.up, pos, byte_mask(), cache.hooks("decoder", n))
        cache.n += 1
        return self.head(self.out_norm(y))

    def _decide(self, cache: ByteCache, n: torch.Tensor):
        """The strategy's decision at each row's new byte (position n), earlier decisions held: (start [B],
        smooth [B] or None)."""
        cfg, b = self.config, self.boundary
        rows = torch.arange(n.shape[0], device=n.device)
        if b.kind == "policy" and cfg.strategy_options.get("window", 1) > 1:
            return self._decide_window(cache, n), None
        L = int(n.max()) + 1
        j = torch.arange(L, device=n.device)
        valid = j[None, :] <= n[:, None]
        x = cache.x[:, :L].masked_fill(~valid, PAD)
        forced = torch.zeros_like(valid)
        if cfg.document_mask:
            forced = (x == SEP) & valid
        forced[:, 0] = True
        noise = None if cache.noise is None else cache.noise[:, :L]
        starts, smooth = b(cache.h[:, :L], x, valid, forced, noise)
        return starts[rows, n], None if smooth is None else smooth[rows, n]

    def _decide_window(self, cache, n):
        """The window policy at position n, from the w - 1 decisions held before it."""
        b, o, cfg = self.boundary, self.config.strategy_options, self.config
        rows = torch.arange(n.shape[0], device=n.device)
        w = o["window"]
        h_t = cache.h[rows, n]
        lag = o.get("lag", 0)
        forced_at = torch.zeros_like(cache.starts)
        forced_at[:, 0] = True
        if cfg.document_mask:
            forced_at |= cache.x == SEP
        L = cache.capacity
        j = torch.arange(L, device=n.device)
        last_forced = torch.where(forced_at & (j[None] <= n[:, None]), j[None], torch.zeros_like(j)[None]).amax(1)
        age = n - last_forced
        if lag:
            h_t = cache.h[rows, (n - lag).clamp(min=0)] * (age >= lag)[:, None].to(h_t.dtype)
        k = torch.arange(1, w, device=n.device)
        prev = cache.starts[rows[:, None], (n[:, None] - k).clamp(min=0)].float() * (age[:, None] >= k)
        noise = None if cache.noise is None else cache.noise[rows, n]
        d = b.window_decision(b.head(h_t).squeeze(-1).float(), b.window_head(h_t).float(), prev, noise,
                              o.get("logit_cap", 6.0))
        is_forced = forced_at[rows, n]
        return d | is_forced

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True,
                                      **kwargs):
        if past_key_values is not None and past_key_values.get_seq_length() > 0:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                "use_cache": use_cache}


def _bucket(n: int) -> int:
    """megatok.model.chunking.bucket: n rounded up to one of 8 sizes per octave."""
    if n <= 64:
        return max(8, -(-n // 8) * 8)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _ema(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """out_j = p_j z_j + (1 - p_j) out_{j-1} along the chunks, out_{-1} = 0 (H-Net's smoothing)."""
    p = p.to(z.dtype)[..., None]
    out, prev = [], torch.zeros_like(z[:, 0])
    for j in range(z.shape[1]):
        prev = p[:, j] * z[:, j] + (1 - p[:, j]) * prev
        out.append(prev)
    return torch.stack(out, 1)
