"""Size and compute of a megatok config, from the config alone (no model, no GPU).

Two of the questions a user asks before spending a cluster allocation, answered analytically here
and checked against the real model (``meta_param_count`` builds it on the meta device) in the tests
(tests/scale/); the third, memory per GPU, is megatok/sizing.py:

1. **Parameters** per component (:func:`param_counts`).
2. **FLOPs per byte** and training FLOPs (:func:`flops_per_byte`, :func:`training_flops`), and a BPE
   token model sized to the same FLOPs per byte (:func:`match_bpe`).

Notation: ``d`` = model.d_model (byte-rate width), ``dm`` = main width (model.d_main or d),
``f(w)`` = SwiGLU hidden size of a width-w block (ffn_mult x w rounded up to ffn_multiple_of),
``V`` = 258 (256 bytes + SEP + PAD), ``T`` = data.seq_len (bytes per sequence), ``rho`` = chunks
per byte (boundary.target_rate, or a realised rate you pass in), ``K = rho T`` chunks per sequence.

Parameters (exact; the test checks them against the instantiated model)::

    block(w)    = 4 w^2 (qkv 3w^2 + out w^2) + 3 w f(w) (gate, up, down) + 2 w (two RMSNorms)
    embeddings  = V d
    encoder     = n_encoder_layers x block(d)
    boundary    = the strategy's own parameters, as its module counts them (policy: a d -> 1 linear with bias,
                  d + 1, plus d + 1 per further window head output and for a value head; fixed: 0)
    main        = n_main_layers x block(dm) + dm (final norm) + 2 d dm (down/up projections, only if dm != d)
    decoder     = n_decoder_layers x block(d)
    heads       = 2 (V d + d)   (next-byte head and early-exit head, each with its RMSNorm)

FLOPs (a multiply-add is 2 FLOPs; a [n, a] x [a, b] product is 2 n a b)::

    per byte, forward:
      byte-rate matmuls  2 (n_enc + n_dec) (block(w) - 2w) at w = d        every byte
      byte attention     (n_enc + n_dec) x 4 d k                             causal: QK^T and AV over the
                                                                             k = (T + 1) / 2 keys a query sees on average
                                                                             (model.byte_window W < T: k = W - W (W - 1) / (2 T))
      main matmuls       rho x 2 n_main (block(dm) - 2 dm)                  every chunk
      main attention     rho x n_main x 2 dm (K + 1)                        causal over K chunks
      down projection    rho x 2 d dm          (at chunk rate; 0 if dm == d)
      up projection      rho x 2 d dm          (per chunk, before upsampling copies it to its bytes)
      boundary           the strategy's own (megatok.boundaries.flops_per_byte; 2 x its parameters
                         for a linear head, e.g. the policy's)
      heads              2 x 2 d V             (next-byte + early-exit logits)
    training = 3 x forward (backward = 2 x forward: gradients for activations and for weights); with
    a strategy's K samples per training sequence (the policy's ``samples``), everything after the
    encoder and its early-exit head runs K times in that forward.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatok import boundaries
from megatok.config import ConfigError
from megatok.metrics import finite_number
from megatok.vocab import VOCAB_SIZE


# Dense bf16 peak of one GPU (TFLOP/s, no sparsity), for MFU: the first key found as whole words in
# torch's device name ("NVIDIA H100 80GB HBM3"), so the PCIe and NVL cards come before the SXM ones.
PEAK_BF16_TFLOPS = {"H200 NVL": 835.0, "H200": 989.0, "GH200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0,
                    "L40S": 362.0, "A10": 125.0}


def peak_tflops_for(name: str) -> float | None:
    """The dense bf16 peak of a GPU by its device name (PEAK_BF16_TFLOPS), or None if unknown."""
    import re

    return next((v for k, v in PEAK_BF16_TFLOPS.items() if re.search(rf"\b{re.escape(k)}\b", name)), None)


def device_peak_tflops(device) -> float | None:
    """The dense bf16 peak of a CUDA device (peak_tflops_for its name), or None (unknown, or not a GPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return peak_tflops_for(torch.cuda.get_device_name(device))


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
    """The boundary strategy's parameters, as its module counts them (megatok.boundaries.param_count)."""
    return boundaries.param_count(cfg.boundary, cfg.model.d_model)


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


def mean_keys(T: float, window: int | None) -> float:
    """Keys a causal query sees on average over a T-long sequence, with a sliding ``window`` or without."""
    if window is None or window >= T:
        return (T + 1) / 2
    return window - window * (window - 1) / (2 * T)


def flops_per_byte(cfg, rate: float | None = None, seq_len: int | None = None) -> dict[str, float]:
    """Forward FLOPs per byte by term, ``forward`` (their sum) and ``training`` (3 x forward; with the
    strategy's K samples per sequence, 3 x the forward with everything after the encoder and the early-exit
    head K times).
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
        "byte_attention": n_byte * 4 * s.d * mean_keys(T, cfg.model.byte_window),
        "main_matmul": rho * 2 * s.n_main * (block_params(s.dm, s.fm) - 2 * s.dm),
        "main_attention": rho * s.n_main * 2 * s.dm * (K + 1),
        "projections": rho * 2 * 2 * s.d * s.dm if s.dm != s.d else 0,  # down and up, both per chunk
        "boundary": boundaries.flops_per_byte(cfg.boundary, s.d),
        "heads": 2 * 2 * s.d * s.vocab,
    }
    terms = {k: float(v) for k, v in terms.items()}
    forward = sum(terms.values())
    samples = boundaries.samples_per_sequence(cfg.boundary)
    trained = forward
    if samples > 1:  # a training forward runs everything after the encoder and the early-exit head that often
        once = {k: (s.n_enc / n_byte if n_byte else 0.0) if k.startswith("byte_") else 0.5 if k == "heads" else 0.0
                for k in terms}  # the encoder's share of the byte-rate terms, the early-exit head's of the heads
        trained = sum(v * (once[k] + samples * (1 - once[k])) for k, v in terms.items())
    terms["forward"] = forward  # the model's own cost per byte (inference, evaluation)
    terms["training"] = 3 * trained
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


def _number(v) -> bool:
    return finite_number(v) is not None


def realised_rate(cfg, train_rows: list[dict]) -> float:
    """The rate a run realised, from its training rows: chunks per byte, the mean of their
    ``boundary_rate``; for kind "bpe" tokens per byte, from their ``bytes_per_token``. default_rate
    where the rows do not say."""
    if is_bpe(cfg):
        per_token = [r["bytes_per_token"] for r in train_rows if _number(r.get("bytes_per_token"))
                     and r["bytes_per_token"] > 0]
        return len(per_token) / sum(per_token) if per_token else default_rate(cfg)
    rates = [r["boundary_rate"] for r in train_rows if _number(r.get("boundary_rate"))]
    return sum(rates) / len(rates) if rates else default_rate(cfg)


def bytes_at(cfg, world_size: int, train_rows: list[dict]):
    """A function of a step: the training bytes a run had seen by then, from its training rows: the
    ``bytes_seen`` logged at that step, else the step x the bytes per step of its last row that logs
    them, else as planned (training_bytes / max_steps, for ``world_size`` ranks)."""
    seen = {r["step"]: r["bytes_seen"] for r in train_rows if _number(r.get("step")) and _number(r.get("bytes_seen"))}
    last = max((s for s in seen if s), default=None)
    per_step = seen[last] / last if last else training_bytes(cfg, world_size) / cfg.train.max_steps
    return lambda step: seen.get(step, step * per_step)


def flops_at(cfg, world_size: int, train_rows: list[dict]):
    """A function of a step: the training FLOPs a run had done by then, from its training rows: the
    ``flops`` it logged at that step; else its bytes seen by then (:func:`bytes_at`) x FLOPs per byte:
    the ratio of its last logged FLOPs to bytes before the step (or of its first), else
    :func:`flops_per_byte` at the :func:`realised_rate`."""
    bytes_seen = bytes_at(cfg, world_size, train_rows)
    logged = sorted((r["step"], r["flops"]) for r in train_rows if _number(r.get("step")) and _number(r.get("flops")))
    per_byte = flops_per_byte(cfg, rate=realised_rate(cfg, train_rows))["training"]

    def at(step: int) -> float:
        if not logged:
            return per_byte * bytes_seen(step)
        s, f = ([x for x in logged if x[0] <= step] or logged[:1])[-1]
        if s == step:
            return f
        return f / bytes_seen(s) * bytes_seen(step) if bytes_seen(s) else per_byte * bytes_seen(step)

    return at


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
