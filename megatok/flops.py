"""Size, compute and memory of a megatok config, from the config alone (no model, no GPU).

Three questions a user asks before spending a cluster allocation, answered analytically here and
checked against the real model (``meta_param_count`` builds it on the meta device) and a real CPU
run in the tests (tests/scale/):

1. **Parameters** per component (:func:`param_counts`).
2. **FLOPs per byte** and training FLOPs (:func:`flops_per_byte`, :func:`training_flops`).
3. **Memory per GPU** for model states under ZeRO 0-3, with and without CPU offload, and an
   activation estimate for the micro-batch (:func:`model_state_bytes`, :func:`activation_bytes`).

Notation: ``d`` = model.d_model (byte-rate width), ``dm`` = main width (model.d_main or d),
``f(w)`` = SwiGLU hidden size of a width-w block (ffn_mult x w rounded up to ffn_multiple_of),
``V`` = 258 (256 bytes + SEP + PAD), ``T`` = data.seq_len (bytes per sequence), ``rho`` = chunks
per byte (boundary.target_rate, or a realised rate you pass in), ``K = rho T`` chunks per sequence.

Parameters (exact; the test checks them against the instantiated model)::

    block(w)    = 4 w^2 (qkv 3w^2 + out w^2) + 3 w f(w) (gate, up, down) + 2 w (two RMSNorms)
    embeddings  = V d
    encoder     = n_encoder_layers x block(d)
    boundary    = the strategy's own parameters (policy: a d -> 1 linear with bias = d + 1; fixed: 0)
    main        = n_main_layers x block(dm) + dm (final norm) + 2 d dm (down/up projections, only if dm != d)
    decoder     = n_decoder_layers x block(d)
    heads       = 2 (V d + d)   (next-byte head and early-exit head, each with its RMSNorm)

FLOPs (a multiply-add is 2 FLOPs; a [n, a] x [a, b] product is 2 n a b)::

    per byte, forward:
      byte-rate matmuls  2 (n_enc + n_dec) (block(w) - 2w) at w = d        every byte
      byte attention     (n_enc + n_dec) x 2 d (T + 1)                       causal: QK^T and AV over the
                                                                             (T + 1) / 2 keys a query sees on average
      main matmuls       rho x 2 n_main (block(dm) - 2 dm)                  every chunk
      main attention     rho x n_main x 2 dm (K + 1)                        causal over K chunks
      down projection    rho x 2 d dm          (at chunk rate; 0 if dm == d)
      up projection      2 d dm                (megatok applies it after upsampling: at byte rate)
      boundary           2 x boundary params   (policy: the d -> 1 head)
      heads              2 x 2 d V             (next-byte + early-exit logits)
    training = 3 x forward (backward = 2 x forward: gradients for activations and for weights).

This is the "6N" accounting (training = 6 x parameters x tokens) made exact for a model whose
layers run at two rates: 6 x (byte-rate params + rho x main params) per byte, plus attention and
the heads. Norms, rotary, softmax, SiLU, the loss and the optimizer are not counted (well under 1%).
Activation checkpointing recomputes the forward in the backward: the hardware does 4 x forward, but
model FLOPs (and MFU, as usual) count 3 x. Chunk counts are padded to the batch maximum in the
implementation; FLOPs here count the expected K = rho T, not the padding.

The BPE token model (model.kind "bpe", megatok/model/token_lm.py) is ``n = n_main_layers`` blocks of
width ``w = dm`` over sentencepiece ids: ``V`` = model.vocab_size, ``T`` = data.seq_len in TOKENS, and
``tau`` = tokens per byte (1 / model.bytes_per_token, or a realised rate you pass in)::

    embeddings  = V w                 (a lookup: no FLOPs)
    main        = n x block(w) + w    (final norm)
    heads       = V w                 (next-token logits, untied; no early exit)
    encoder = boundary = decoder = 0

    per byte, forward:
      main matmuls       tau x 2 n (block(w) - 2 w)                         every token
      main attention     tau x n x 2 w (T + 1)                              causal over T tokens
      heads              tau x 2 w V
    (byte-rate terms, projections and boundary are 0; training = 3 x forward, as above.)

The two models are compared at equal training FLOPs per byte: :func:`match_bpe` sizes the token
model for a unet config. Training bytes of a BPE run are expected bytes: steps x global batch x
seq_len tokens x bytes_per_token.

Memory is modelled in :func:`model_state_bytes` (see its docstring for each term).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from megatok.vocab import VOCAB_SIZE

GIB = 2**30

# Dense bf16 peak of one GPU (TFLOP/s, no sparsity), for MFU. Matched against torch's device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


# ----------------------------------------------------------------------------- shapes and parameters

def ffn_hidden(w: int, mult: float, multiple_of: int) -> int:
    """Same rule as megatok.model.blocks.ffn_hidden (kept here so this module needs no torch)."""
    return multiple_of * math.ceil(w * mult / multiple_of)


@dataclass(frozen=True)
class Shape:
    d: int
    heads: int
    f: int
    dm: int
    main_heads: int
    fm: int
    n_enc: int
    n_main: int
    n_dec: int
    vocab: int = VOCAB_SIZE
    bpe: bool = False

    @classmethod
    def of(cls, model_cfg) -> "Shape":
        m = model_cfg
        dm = m.main_width
        bpe = m.kind == "bpe"
        return cls(d=m.d_model, heads=m.n_heads, f=ffn_hidden(m.d_model, m.ffn_mult, m.ffn_multiple_of),
                   dm=dm, main_heads=m.main_heads, fm=ffn_hidden(dm, m.ffn_mult, m.ffn_multiple_of),
                   n_enc=0 if bpe else m.n_encoder_layers, n_main=m.n_main_layers,
                   n_dec=0 if bpe else m.n_decoder_layers, vocab=m.vocab_size if bpe else VOCAB_SIZE, bpe=bpe)


def is_bpe(cfg) -> bool:
    return cfg.model.kind == "bpe"


def block_params(w: int, f: int) -> int:
    """One transformer block: qkv + out (4 w^2), SwiGLU (3 w f), two RMSNorm weights (2 w)."""
    return 4 * w * w + 3 * w * f + 2 * w


def boundary_params(cfg) -> int:
    """The boundary strategy's parameters: by formula for the strategies this module knows, otherwise
    counted from the strategy module built on the meta device (so a new strategy is always right)."""
    name, d = cfg.boundary.strategy, cfg.model.d_model
    if name == "policy":
        return d + 1
    if name == "fixed":
        return 0
    import torch

    from megatok.boundaries import build_strategy

    with torch.device("meta"):
        s = build_strategy(name, d_model=d, target_rate=cfg.boundary.target_rate, options=cfg.boundary.options)
    return sum(p.numel() for p in s.parameters())


def param_counts(cfg) -> dict[str, int]:
    """Parameters per component; ``total`` is their sum. ``main`` includes the down/up projections
    between the two widths and the main network's final norm."""
    s = Shape.of(cfg.model)
    if s.bpe:
        counts = {"embeddings": s.vocab * s.dm, "encoder": 0, "boundary": 0,
                  "main": s.n_main * block_params(s.dm, s.fm) + s.dm, "decoder": 0, "heads": s.vocab * s.dm}
        counts["total"] = sum(counts.values())
        return counts
    proj = 2 * s.d * s.dm if s.dm != s.d else 0
    counts = {
        "embeddings": s.vocab * s.d,
        "encoder": s.n_enc * block_params(s.d, s.f),
        "boundary": boundary_params(cfg),
        "main": s.n_main * block_params(s.dm, s.fm) + s.dm + proj,
        "decoder": s.n_dec * block_params(s.d, s.f),
        "heads": 2 * (s.vocab * s.d + s.d),
    }
    counts["total"] = sum(counts.values())
    return counts


# Which top-level module of ByteUNet (or TokenLM: embed, main, main_norm, head) belongs to which component
# (for the test that checks the formulas).
MODULE_COMPONENT = {
    "embed": "embeddings", "encoder": "encoder", "boundary": "boundary", "down_proj": "main", "main": "main",
    "main_norm": "main", "up_proj": "main", "decoder": "decoder", "out_norm": "heads", "head": "heads",
    "early_norm": "heads", "early_head": "heads",
}


def build_meta_model(cfg):
    """The real model (ByteUNet, or TokenLM for kind "bpe", whose tokenizer is not read) on the meta
    device: shapes and parameters without memory (13B in a second)."""
    import torch

    from megatok.model import build_model

    with torch.device("meta"):
        return build_model(cfg, sizing_only=True)


def meta_param_counts(model) -> dict[str, int]:
    """Parameters of an instantiated model grouped by :data:`MODULE_COMPONENT`, plus ``total``."""
    out = {k: 0 for k in ("embeddings", "encoder", "boundary", "main", "decoder", "heads")}
    for name, p in model.named_parameters():
        out[MODULE_COMPONENT[name.split(".")[0]]] += p.numel()
    out["total"] = sum(p.numel() for p in model.parameters())
    return out


# ----------------------------------------------------------------------------- FLOPs

def default_rate(cfg) -> float:
    """Chunks per byte (boundary.target_rate), or for kind "bpe" tokens per byte (1 / model.bytes_per_token)."""
    return 1 / cfg.model.bytes_per_token if is_bpe(cfg) else cfg.boundary.target_rate


def bpe_terms(w: int, f: int, n: int, vocab: int, rate: float, T: float) -> dict[str, float]:
    """Forward FLOPs per byte of the BPE token model by term (see the module docstring)."""
    terms = {"byte_matmul": 0.0, "byte_attention": 0.0,
             "main_matmul": rate * 2 * n * (block_params(w, f) - 2 * w),
             "main_attention": rate * n * 2 * w * (T + 1),
             "projections": 0.0, "boundary": 0.0,
             "heads": rate * 2 * w * vocab}
    terms = {k: float(v) for k, v in terms.items()}
    terms["forward"] = sum(terms.values())
    terms["training"] = 3 * terms["forward"]
    return terms


def flops_per_byte(cfg, rate: float | None = None, seq_len: int | None = None) -> dict[str, float]:
    """Forward FLOPs per byte by term, ``forward`` (their sum) and ``training`` (3 x forward).
    ``rate``: chunks per byte (default boundary.target_rate), for kind "bpe" tokens per byte (default
    1 / model.bytes_per_token); ``seq_len``: default data.seq_len (tokens for kind "bpe")."""
    s = Shape.of(cfg.model)
    if s.bpe:
        return bpe_terms(s.dm, s.fm, s.n_main, s.vocab, default_rate(cfg) if rate is None else rate,
                         cfg.data.seq_len if seq_len is None else seq_len)
    rho = cfg.boundary.target_rate if rate is None else rate
    T = cfg.data.seq_len if seq_len is None else seq_len
    K = rho * T
    n_byte = s.n_enc + s.n_dec
    terms = {
        "byte_matmul": 2 * n_byte * (block_params(s.d, s.f) - 2 * s.d),
        "byte_attention": n_byte * 2 * s.d * (T + 1),
        "main_matmul": rho * 2 * s.n_main * (block_params(s.dm, s.fm) - 2 * s.dm),
        "main_attention": rho * s.n_main * 2 * s.dm * (K + 1),
        "projections": (rho * 2 * s.d * s.dm + 2 * s.d * s.dm) if s.dm != s.d else 0,
        "boundary": 2 * boundary_params(cfg),
        "heads": 2 * 2 * s.d * s.vocab,
    }
    terms = {k: float(v) for k, v in terms.items()}
    terms["forward"] = sum(terms.values())
    terms["training"] = 3 * terms["forward"]
    return terms


def bytes_per_sequence(cfg) -> float:
    """data.seq_len bytes, or for kind "bpe" seq_len tokens x model.bytes_per_token (expected bytes)."""
    return cfg.data.seq_len * cfg.model.bytes_per_token if is_bpe(cfg) else cfg.data.seq_len


def training_bytes(cfg, world_size: int) -> int:
    """Bytes the run trains on: max_steps x global batch x seq_len (global batch for this world size);
    for kind "bpe" the expected bytes, seq_len tokens x bytes_per_token per sequence (rounded)."""
    t = cfg.train
    n = t.max_steps * t.micro_batch_size * (t.grad_accum or 1) * world_size
    return n * cfg.data.seq_len if not is_bpe(cfg) else int(round(n * bytes_per_sequence(cfg)))


def training_flops(cfg, world_size: int, rate: float | None = None) -> float:
    return flops_per_byte(cfg, rate)["training"] * training_bytes(cfg, world_size)


# ----------------------------------------------------------------------------- matching a BPE baseline

def round_vocab(n: int, multiple: int = 64) -> int:
    """Embedding rows for a tokenizer of n pieces: n rounded up to a multiple of 64."""
    return multiple * math.ceil(n / multiple)


def match_bpe(cfg, *, tokenizer: str, vocab_size: int, bytes_per_token: float,
              rate: float | None = None) -> dict[str, Any]:
    """Size a BPE token model to the training FLOPs per byte of the unet config ``cfg`` (at its
    boundary.target_rate, or ``rate`` chunks per byte).

    The head dimension of the unet's main network is kept; widths w are multiples of 64 and of that
    head dimension from about dm / 2 to 2 dm, depths n from 1 to 4 n_main + 4, and the candidate
    minimising |log(F_bpe / F_target)| + 0.1 |log(w / dm)| wins (close to the main network's width
    unless that cannot match). data.seq_len becomes round(seq_len bytes / bytes_per_token) tokens, so
    a sequence covers the same bytes; model.vocab_size is ``vocab_size`` (the tokenizer's pieces)
    rounded up to a multiple of 64. Returns ``{"overrides": {"model": ..., "data": {"seq_len": ...}},
    "flops_per_byte", "target_flops_per_byte", "ratio", "params", "target_params", "width", "layers"}``
    (FLOPs per byte are training FLOPs)."""
    from megatok.config import ConfigError

    if cfg.model.kind != "unet":
        raise ConfigError(f"match_bpe needs a unet config to match, got model.kind '{cfg.model.kind}'")
    if vocab_size <= 0 or bytes_per_token <= 0:
        raise ConfigError(f"vocab_size and bytes_per_token must be positive (got {vocab_size}, {bytes_per_token})")
    m = cfg.model
    target = flops_per_byte(cfg, rate)["training"]
    dm, hd = m.main_width, m.main_width // m.main_heads
    V = round_vocab(vocab_size)
    T = max(2, round(cfg.data.seq_len / bytes_per_token))
    tau = 1 / bytes_per_token
    step = math.lcm(64, hd)
    lo, hi = max(1, math.ceil(dm / 2 / step)), max(1, math.floor(2 * dm / step))
    widths = [k * step for k in range(lo, max(lo, hi) + 1)]
    best = None
    for w in widths:
        f = ffn_hidden(w, m.ffn_mult, m.ffn_multiple_of)
        for n in range(1, 4 * m.n_main_layers + 5):
            got = bpe_terms(w, f, n, V, tau, T)["training"]
            score = abs(math.log(got / target)) + 0.1 * abs(math.log(w / dm))
            if best is None or score < best[0]:
                best = (score, w, n, f, got)
    _, w, n, f, got = best
    model = {"kind": "bpe", "tokenizer": str(tokenizer), "vocab_size": V, "bytes_per_token": float(bytes_per_token),
             "d_main": w, "n_main_heads": w // hd, "n_main_layers": n, "n_encoder_layers": 0, "n_decoder_layers": 0}
    return {"overrides": {"model": model, "data": {"seq_len": T}},
            "flops_per_byte": got, "target_flops_per_byte": target, "ratio": got / target,
            "params": 2 * V * w + n * block_params(w, f) + w, "target_params": param_counts(cfg)["total"],
            "width": w, "layers": n}


# ----------------------------------------------------------------------------- memory

def _zero_section(cfg) -> dict:
    return dict(cfg.deepspeed.get("zero_optimization", {}))


def _offload(zero: dict, key: str) -> bool:
    sec = zero.get(key) or {}
    return isinstance(sec, dict) and sec.get("device", "none") in ("cpu", "nvme")


def model_state_bytes(P: int, *, stage: int, world: int, bf16: bool, offload_optimizer: bool = False,
                      offload_param: bool = False, reduce_bucket: int = int(5e8), prefetch_bucket: int = int(5e7),
                      max_reuse_distance: int = int(1e9), overlap_comm: bool | None = None,
                      largest_layer: int = 0) -> dict[str, float]:
    """Peak bytes per rank for parameters, gradients, AdamW states and DeepSpeed's buffers (ZeRO as
    implemented in DeepSpeed 0.19), as ``{"device": ..., "host": ..., **items}``; an item lives on the
    device (GPU) unless its name starts with ``host_``. ``w`` = 2 bytes (bf16) or 4 (fp32) for the
    working copy of params and grads, ``N`` = data-parallel ranks. Bytes per parameter:

    ==========================  ==========  ==========  ==========  ==========
    item                        ZeRO-0      ZeRO-1      ZeRO-2      ZeRO-3
    ==========================  ==========  ==========  ==========  ==========
    params (working dtype)      w           w           w           w / N
    grads (working dtype)       w           w + w / N   w / N       w / N
    fp32 master params          4 | 0       4 / N       4 / N       4 / N
    fp32 grads for the update   4 | 0       4 / N       4 / N       4 / N
    AdamW exp_avg + exp_avg_sq  8           8 / N       8 / N       8 / N
    AdamW step temporary        4           4 / N       4 / N       4 / N
    ==========================  ==========  ==========  ==========  ==========

    (``4 | 0``: bf16 | fp32.) This is the ZeRO paper's 2 + 2 + 12 bytes with what DeepSpeed adds:
    under ZeRO-0, bf16 runs DeepSpeed's BF16/FP16 optimizer, which keeps a full fp32 master and fp32
    gradients; ZeRO-1/2/3 always clone an fp32 master partition (also when the model is fp32) and build
    an fp32 gradient partition for the update; ZeRO-1 also copies its own gradient partition into a
    contiguous buffer next to the full gradients; torch's AdamW computes sqrt(exp_avg_sq) into a
    temporary the size of the (flat) partition it updates. Buffers, x w: the gradient reduce bucket
    (``contiguous_gradients``, the default) of min(reduce_bucket_size, P) elements, twice under ZeRO-1/2
    with ``overlap_comm`` (double buffering); under ZeRO-3 also the gathered full parameters: DeepSpeed
    keeps a gathered parameter until its next use if that comes within ``stage3_max_reuse_distance``
    elements of traffic, which between forward and backward keeps about min(P, max_reuse_distance / 2
    + the largest layer + the prefetch bucket) gathered.

    CPU offload (``offload_optimizer``) moves the fp32 master, fp32 grads, AdamW states and its
    temporary to host RAM (ZeRO-1/2 add a w / N staging copy there); ``offload_param`` (ZeRO-3) moves
    the parameter partition too. The bucket counts min(bucket, P): on a CPU only the part that is
    written becomes resident, while a GPU allocates the whole bucket, so keep reduce_bucket_size below
    P on GPUs (configs/gpu-base.json sets 2e8). Checked against peak RSS of real 2-rank CPU runs under
    ZeRO-2 and ZeRO-3 (tests/scale/test_memory.py); ZeRO-0/1 and the offload rows are not measured.
    """
    N, w = world, (2 if bf16 else 4)
    shard = 1 / N
    items: dict[str, float] = {}
    items["params"] = w * P * (shard if stage == 3 else 1)
    items["grads"] = w * P * (shard if stage >= 2 else (1 + shard if stage == 1 else 1))
    if stage == 0:
        items["master_params"] = 4 * P if bf16 else 0
        items["master_grads"] = 4 * P if bf16 else 0
        items["optimizer"] = 8 * P
        items["optimizer_temp"] = 4 * P
    else:
        items["master_params"] = 4 * P * shard
        items["master_grads"] = 4 * P * shard
        items["optimizer"] = 8 * P * shard
        items["optimizer_temp"] = 4 * P * shard
    if overlap_comm is None:
        overlap_comm = stage == 3  # DeepSpeed's default
    items["reduce_bucket"] = 0.0 if stage == 0 else w * min(reduce_bucket, P) * (2 if overlap_comm and stage < 3 else 1)
    items["gathered_params"] = (w * min(P, max_reuse_distance // 2 + largest_layer + prefetch_bucket)
                                if stage == 3 else 0.0)
    if offload_optimizer and stage >= 1:
        for k in ("master_params", "master_grads", "optimizer", "optimizer_temp"):
            items["host_" + k] = items.pop(k)
        if stage in (1, 2):
            items["host_staging"] = w * P * shard
    if offload_param and stage == 3:
        items["host_params"] = items.pop("params")
    items["device"] = sum(v for k, v in items.items() if not k.startswith("host_"))
    items["host"] = sum(v for k, v in items.items() if k.startswith("host_"))
    return items


def zero_kwargs(cfg) -> dict[str, Any]:
    """The DeepSpeed settings :func:`model_state_bytes` reads, from the config (DeepSpeed's defaults
    where unset)."""
    z = _zero_section(cfg)

    def get(*keys, default):
        for k in keys:
            if k in z:
                return z[k]
        return default

    return dict(reduce_bucket=int(get("reduce_bucket_size", default=5e8)),
                prefetch_bucket=int(get("stage3_prefetch_bucket_size", "prefetch_bucket_size", default=5e7)),
                max_reuse_distance=int(get("stage3_max_reuse_distance", "max_reuse_distance", default=1e9)),
                overlap_comm=z.get("overlap_comm"), largest_layer=largest_layer_params(cfg))


def activation_bytes(cfg, micro_batch: int | None = None, *, checkpointing: bool | None = None,
                     bf16: bool | None = None, rate: float | None = None) -> dict[str, float]:
    """Activations saved for the backward of one micro-batch, per rank (an estimate).

    Per token and block of width w (elements, x 2 bytes in bf16 / 4 in fp32), from what autograd
    keeps in megatok's block: the RMSNorm inputs and outputs (4 w), the qkv output (3 w, alive
    through the view of v), rotated q and k (2 w), the attention output (w), the SwiGLU gate, up,
    silu and product (4 f): ``10 w + 4 f``. Flash/SDPA attention keeps O(T) statistics, not T^2.
    Byte-rate blocks see B T tokens, main blocks B rho T (plus padding to the batch maximum).
    With activation checkpointing a block keeps only its input (w per token), plus one block's full
    set while it is recomputed. Outside the blocks: the embeddings and encoder output (2 d), the
    upsampled main output (2 d), and the two heads' logits with their fp32 copies and log-softmax
    (2 V (w_bytes + 8) bytes per byte).

    Kind "bpe" (kept simple): n_main_layers blocks of width w at B T tokens (T = seq_len tokens), as
    above, plus the embedding and final-norm outputs (2 w) and one head's logits with its fp32 copy
    and log-softmax (V (w_bytes + 8) bytes per token). ``rate`` does not apply.
    """
    s = Shape.of(cfg.model)
    B = cfg.train.micro_batch_size if micro_batch is None else micro_batch
    T = cfg.data.seq_len
    rho = cfg.boundary.target_rate if rate is None else rate
    ckpt = cfg.model.activation_checkpointing if checkpointing is None else checkpointing
    from megatok.config import uses_bf16

    eb = 2 if (uses_bf16(cfg) if bf16 is None else bf16) else 4

    def full(w, f):
        return (10 * w + 4 * f) * eb

    if s.bpe:
        tokens = B * T
        if ckpt:
            blocks = s.n_main * tokens * s.dm * eb + tokens * full(s.dm, s.fm)
        else:
            blocks = s.n_main * tokens * full(s.dm, s.fm)
        other = tokens * (2 * s.dm * eb + s.vocab * (eb + 8))
        return {"blocks": float(blocks), "other": float(other), "total": float(blocks + other)}

    byte_tokens, main_tokens = B * T, B * rho * T
    n_byte = s.n_enc + s.n_dec
    if ckpt:
        blocks = (n_byte * byte_tokens * s.d + s.n_main * main_tokens * s.dm) * eb
        blocks += max(byte_tokens * full(s.d, s.f) if n_byte else 0, main_tokens * full(s.dm, s.fm))
    else:
        blocks = n_byte * byte_tokens * full(s.d, s.f) + s.n_main * main_tokens * full(s.dm, s.fm)
    other = byte_tokens * (4 * s.d * eb + 2 * s.vocab * (eb + 8)) + main_tokens * 2 * s.dm * eb
    return {"blocks": float(blocks), "other": float(other), "total": float(blocks + other)}


def largest_layer_params(cfg) -> int:
    s = Shape.of(cfg.model)
    if s.bpe:
        return max(block_params(s.dm, s.fm), s.vocab * s.dm)
    return max(block_params(s.d, s.f), block_params(s.dm, s.fm) if s.n_main else 0, s.vocab * s.d)


def memory_table(cfg, world: int) -> dict[str, Any]:
    """Per-rank model-state memory for every ZeRO stage x offload choice, and activations."""
    P = param_counts(cfg)["total"]
    zero = _zero_section(cfg)
    from megatok.config import uses_bf16, zero_stage

    bf16 = uses_bf16(cfg)
    kw = dict(world=world, bf16=bf16, **zero_kwargs(cfg))
    rows = []
    for stage in (0, 1, 2, 3):
        for off_opt, off_par in ((False, False), (True, False), (True, True)):
            if (off_opt and stage == 0) or (off_par and stage != 3):
                continue
            m = model_state_bytes(P, stage=stage, offload_optimizer=off_opt, offload_param=off_par, **kw)
            offload = "optimizer+params" if off_par else ("optimizer" if off_opt else "none")
            rows.append({"stage": stage, "offload": offload, "gpu_bytes": m["device"], "host_bytes": m["host"]})
    act = {"configured": activation_bytes(cfg),
           "checkpointing": activation_bytes(cfg, checkpointing=True),
           "no_checkpointing": activation_bytes(cfg, checkpointing=False)}
    configured = model_state_bytes(P, stage=zero_stage(cfg), offload_optimizer=_offload(zero, "offload_optimizer"),
                                   offload_param=_offload(zero, "offload_param"), **kw)
    return {"world": world, "bf16": bf16, "stages": rows, "activations": act, "configured": {
        "stage": zero_stage(cfg), "model_states_gpu_bytes": configured["device"], "host_bytes": configured["host"],
        "activation_bytes": act["configured"]["total"],
        "total_gpu_bytes": configured["device"] + act["configured"]["total"],
        # Before DeepSpeed partitions anything, every rank builds the whole model in fp32 on the host and
        # the engine moves a full working copy to its device.
        "init_host_bytes": 4 * P, "init_gpu_bytes": (2 if bf16 else 4) * P}}


# ----------------------------------------------------------------------------- the report

def size_report(cfg, *, gpus: int = 8, nodes: int = 1, rate: float | None = None,
                model=None) -> dict[str, Any]:
    """Everything tools/model_size.py and ``pretrain.py --dry-run`` print. ``model``: an instantiated
    (meta) model to check the count against; built here when not given."""
    world = gpus * nodes
    counts = param_counts(cfg)
    model = build_meta_model(cfg) if model is None else model
    instantiated = sum(p.numel() for p in model.parameters())
    fpb = flops_per_byte(cfg, rate)
    n_bytes = training_bytes(cfg, world)
    return {
        "kind": cfg.model.kind,
        "world": {"gpus_per_node": gpus, "nodes": nodes, "ranks": world},
        "params": counts, "params_instantiated": instantiated,
        "rate": default_rate(cfg) if rate is None else rate, "seq_len": cfg.data.seq_len,
        "seq_unit": "tokens" if is_bpe(cfg) else "bytes",
        "flops_per_byte": fpb, "training_bytes": n_bytes, "training_flops": fpb["training"] * n_bytes,
        "batch": {"micro": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum,
                  "global": cfg.train.micro_batch_size * (cfg.train.grad_accum or 1) * world,
                  "max_steps": cfg.train.max_steps},
        "memory": memory_table(cfg, world),
    }


def _h(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def format_report(r: dict[str, Any]) -> str:
    p, f, mem = r["params"], r["flops_per_byte"], r["memory"]
    w = r["world"]
    bpe = r.get("kind") == "bpe"
    unit = r.get("seq_unit", "bytes")
    lines = [f"parameters (instantiated on the meta device: {r['params_instantiated']:,})",
             "| component | params | share |", "|---|---:|---:|"]
    for k, v in p.items():
        lines.append(f"| {k} | {v:,} | {100 * v / p['total']:.1f}% |")
    at = (f"{r['rate']:g} tokens per byte ({1 / r['rate']:.3g} bytes/token)" if bpe else f"rate {r['rate']:g}")
    lines += ["", f"FLOPs per byte at {at} (seq_len {r['seq_len']} {unit}; forward terms, training = 3 x forward)",
              "| term | FLOPs/byte |", "|---|---:|"]
    for k, v in f.items():
        lines.append(f"| {k} | {_h(v)} |")
    b = r["batch"]
    seq = (f"{r['seq_len']} tokens x {1 / r['rate']:.3g} bytes/token" if bpe else f"{r['seq_len']} bytes")
    lines += ["", f"training: {b['max_steps']:,} steps x {b['global']} sequences x {seq} = "
              f"{_h(r['training_bytes'])} bytes -> {r['training_flops']:.3e} FLOPs "
              f"({w['nodes']} node(s) x {w['gpus_per_node']} GPU(s), micro {b['micro']}, accum {b['grad_accum']})",
              "", f"memory per GPU for model states ({'bf16 + fp32 master' if mem['bf16'] else 'fp32'}, "
              f"{w['ranks']} data-parallel ranks), GiB",
              "| ZeRO | offload | GPU | host RAM per rank |", "|---:|---|---:|---:|"]
    for row in mem["stages"]:
        lines.append(f"| {row['stage']} | {row['offload']} | {row['gpu_bytes'] / GIB:.2f} | {row['host_bytes'] / GIB:.2f} |")
    a, c = mem["activations"], mem["configured"]
    lines += ["", f"activations per micro-batch ({b['micro']} x {r['seq_len']} {unit}): "
              f"{a['no_checkpointing']['total'] / GIB:.2f} GiB without checkpointing, "
              f"{a['checkpointing']['total'] / GIB:.2f} GiB with",
              f"as configured (ZeRO-{c['stage']}): model states {c['model_states_gpu_bytes'] / GIB:.2f} GiB + "
              f"activations {c['activation_bytes'] / GIB:.2f} GiB = {c['total_gpu_bytes'] / GIB:.2f} GiB per GPU"
              + (f", {c['host_bytes'] / GIB:.2f} GiB host RAM per rank" if c["host_bytes"] else ""),
              f"at start-up each rank builds the model in fp32 on the host ({c['init_host_bytes'] / GIB:.2f} GiB) and "
              f"moves a full copy to its GPU ({c['init_gpu_bytes'] / GIB:.2f} GiB) before ZeRO partitions it"]
    return "\n".join(lines)


def report_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2)


def quiet_deepspeed_import() -> None:
    """Import DeepSpeed (load_config needs its ZeRO schema) with its start-up log line on stderr, so
    that stdout carries only the report (``--json`` output stays parseable)."""
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401


def dry_run(config: str, overrides: list[str] = (), world: int | None = None, out=None) -> int:
    """``launch/pretrain.py --dry-run``: resolve the config for ``world`` ranks (default $WORLD_SIZE,
    else 8: one node), build the model on the meta device, print the size table and the DeepSpeed
    config the trainer would hand to deepspeed.initialize. No data, no process group. Returns the
    exit code (2 on a config mistake, as the trainer)."""
    import os
    import sys

    from megatok.config import ConfigError, deepspeed_config, load_config

    out = out or sys.stdout
    quiet_deepspeed_import()
    if world is None or world < 1:
        world = int(os.environ.get("WORLD_SIZE", "8"))
    try:
        cfg = load_config(config, list(overrides), world_size=world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = build_meta_model(cfg)
    report = size_report(cfg, gpus=world, nodes=1, model=model)
    print(f"dry run: {config}, {world} rank(s); model built on the meta device, no data read, no process group",
          file=out)
    print(format_report(report), file=out)
    print(f"\nresolved DeepSpeed config ({world} ranks):", file=out)
    print(json.dumps(deepspeed_config(cfg, world), indent=2), file=out)
    return 0
