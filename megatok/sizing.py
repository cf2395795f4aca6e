"""Memory per GPU of a megatok config under ZeRO 0-3, and the size report that puts parameters,
FLOPs (megatok/flops.py) and memory together (megatok.size_report prints it: ``megatok-model-size``,
``launch/pretrain.py --dry-run``).

Model states under ZeRO 0-3, with and without CPU offload (:func:`model_state_bytes`, see its
docstring for each term), and an activation estimate for the micro-batch (:func:`activation_bytes`),
checked against the measured peak of real CPU runs in tests/scale/test_memory.py.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from megatok.dsconfig import builds_partitioned, uses_bf16, zero_stage
from megatok.flops import (Shape, block_params, build_meta_model, default_rate, flops_per_byte, is_bpe,
                           param_counts, training_bytes)

GIB = 2**30


# ----------------------------------------------------------------------------- memory

def _zero_section(cfg) -> dict:
    return dict(cfg.deepspeed.get("zero_optimization", {}))


def _offload(zero: dict, key: str) -> bool:
    sec = zero.get(key) or {}
    return isinstance(sec, dict) and sec.get("device", "none") in ("cpu", "nvme")


def model_state_bytes(P: int, *, stage: int, world: int, bf16: bool, offload_optimizer: bool = False,
                      offload_param: bool = False, reduce_bucket: int = int(5e8), prefetch_bucket: int = int(5e7),
                      max_reuse_distance: int = int(1e9), overlap_comm: bool | None = None,
                      largest_layer: int = 0, grad_accum_fp32: bool = False) -> dict[str, float]:
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

    ``grad_accum_fp32`` (bf16 with ``deepspeed.data_types.grad_accum_dtype`` "fp32", which megatok allows
    under ZeRO-2/3 only; ignored for the ZeRO-0/1 rows): the gradient partition is fp32 (4 / N). Under
    ZeRO-2 DeepSpeed then hands that buffer to the update as is, with no fp32 copy (4 / N in all, not
    w / N + 4 / N); under ZeRO-3 the update still gets its own fp32 copy (4 / N + 4 / N); measured
    in docs/scaling.md.

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
    fp32_accum = bf16 and grad_accum_fp32 and stage >= 2
    items["grads"] = (4 if fp32_accum else w) * P * (shard if stage >= 2 else (1 + shard if stage == 1 else 1))
    if stage == 0:
        items["master_params"] = 4 * P if bf16 else 0
        items["master_grads"] = 4 * P if bf16 else 0
        items["optimizer"] = 8 * P
        items["optimizer_temp"] = 4 * P
    else:
        items["master_params"] = 4 * P * shard
        items["master_grads"] = 0.0 if fp32_accum and stage == 2 else 4 * P * shard
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
                overlap_comm=z.get("overlap_comm"), largest_layer=largest_layer_params(cfg),
                grad_accum_fp32=cfg.deepspeed.get("data_types", {}).get("grad_accum_dtype") in FP32_NAMES)


#: the names DeepSpeed's DtypeEnum reads as fp32 (deepspeed.data_types.grad_accum_dtype)
FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


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

    With ``model.document_mask`` each stack also keeps its additive [B, T, T] attention mask in the
    compute dtype, shared by its layers: w_bytes per element (``masks``). On a GPU, SDPA's
    memory-efficient backend may pad a mask whose length is not a multiple of 16 (the main
    network's, of chunk-count length) into a copy per layer; not counted.
    """
    s = Shape.of(cfg.model)
    B = cfg.train.micro_batch_size if micro_batch is None else micro_batch
    T = cfg.data.seq_len
    rho = cfg.boundary.target_rate if rate is None else rate
    ckpt = cfg.model.activation_checkpointing if checkpointing is None else checkpointing
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
        masks = B * T * T * eb if cfg.model.document_mask else 0
        return {"blocks": float(blocks), "other": float(other), "masks": float(masks),
                "total": float(blocks + other + masks)}

    byte_tokens, main_tokens = B * T, B * rho * T
    n_byte = s.n_enc + s.n_dec
    if ckpt:
        blocks = (n_byte * byte_tokens * s.d + s.n_main * main_tokens * s.dm) * eb
        blocks += max(byte_tokens * full(s.d, s.f) if n_byte else 0, main_tokens * full(s.dm, s.fm))
    else:
        blocks = n_byte * byte_tokens * full(s.d, s.f) + s.n_main * main_tokens * full(s.dm, s.fm)
    other = byte_tokens * (4 * s.d * eb + 2 * s.vocab * (eb + 8)) + main_tokens * 2 * s.dm * eb
    masks = 0.0
    if cfg.model.document_mask:  # encoder, decoder (byte rate) and main (chunk rate) masks
        stacks = (s.n_enc > 0) + (s.n_dec > 0)
        masks = (stacks * B * T * T + B * (rho * T) ** 2) * eb
    return {"blocks": float(blocks), "other": float(other), "masks": float(masks),
            "total": float(blocks + other + masks)}


def max_chunk_rate(cfg) -> float:
    """The most chunks per byte the main network may hold: model.chunk_capacity's length (rounded up as
    megatok.model.chunking.chunk_slots rounds it) over data.seq_len, or 1 without a capacity (a policy
    that starts a chunk at every byte runs the main network at byte rate)."""
    from megatok.model.chunking import bucket

    c, T = cfg.model.chunk_capacity, cfg.data.seq_len
    return 1.0 if c is None else min(T, bucket(math.ceil(c * T))) / T


def largest_layer_params(cfg) -> int:
    s = Shape.of(cfg.model)
    if s.bpe:
        return max(block_params(s.dm, s.fm), s.vocab * s.dm)
    return max(block_params(s.d, s.f), block_params(s.dm, s.fm) if s.n_main else 0, s.vocab * s.d)


def memory_table(cfg, world: int) -> dict[str, Any]:
    """Per-rank model-state memory for every ZeRO stage x offload choice, and activations."""
    P = param_counts(cfg)["total"]
    zero = _zero_section(cfg)
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
    w = 2 if bf16 else 4
    partitioned = builds_partitioned(cfg)
    if partitioned:
        # deepspeed.zero.Init: each module is created in the working precision where its partitions live
        # (the GPU, or the host with offload_param) and partitioned at once; at most one layer is whole.
        shards = w * P / world + w * largest_layer_params(cfg)
        init_host, init_gpu = (shards, 0.0) if _offload(zero, "offload_param") else (0.0, shards)
    else:
        # Every rank builds the whole model in fp32 on its GPU (megatok/train/engine.py build), which the
        # engine then casts to the working precision one parameter at a time.
        init_host, init_gpu = 0.0, 4 * P
    out = {"world": world, "bf16": bf16, "stages": rows, "activations": act, "configured": {
        "stage": zero_stage(cfg), "model_states_gpu_bytes": configured["device"], "host_bytes": configured["host"],
        "activation_bytes": act["configured"]["total"],
        "total_gpu_bytes": configured["device"] + act["configured"]["total"],
        "init_partitioned": partitioned, "init_host_bytes": float(init_host), "init_gpu_bytes": float(init_gpu)}}
    if not is_bpe(cfg):  # the boundaries' rate moves; the capacity (or every byte) is the most it can cost
        rate = max_chunk_rate(cfg)
        most = activation_bytes(cfg, rate=rate)["total"]
        out["at_most"] = {"rate": rate, "capacity": cfg.model.chunk_capacity, "activation_bytes": most,
                          "total_gpu_bytes": configured["device"] + most}
    return out


# ----------------------------------------------------------------------------- checkpoint size on disk


def checkpoint_bytes(P: int, *, stage: int, world: int, bf16: bool) -> dict[str, float]:
    """Bytes on disk of one DeepSpeed checkpoint of P parameters trained with AdamW (as DeepSpeed 0.19
    writes them; torch.save's archive adds a few kB per file), by file:

    ==========================================  =============  ==============  ==============
    file                                        ZeRO-0         ZeRO-1/2        ZeRO-3
    ==========================================  =============  ==============  ==============
    ``mp_rank_00_model_states.pt``              w + 8 (+ 4)    w               -
    ``*zero_pp_rank_<r>_*_optim_states.pt``     -              12 / N each     12 / N each
    ==========================================  =============  ==============  ==============

    (bytes per parameter; w = 2 in bf16, 4 in fp32; N ranks.) Without ZeRO the one file holds the
    weights in the working dtype and the whole optimizer: AdamW's exp_avg and exp_avg_sq in fp32 (8),
    plus the fp32 master (4) under bf16. ZeRO-1/2 keep the working-dtype weights there and give every
    rank a file of its partition of the fp32 master, exp_avg and exp_avg_sq (12 / N); ZeRO-3 writes no
    whole weights at all (its per-rank ``model_states`` files hold shapes only, a few kB): the fp32
    master in the optimizer files is the model. Measured against real checkpoints of every stage in
    tests/scale/test_checkpoint_size.py. CPU offload does not change what is written.
    """
    w = 2 if bf16 else 4
    weights = float(w * P) if stage < 3 else 0.0
    optimizer = float((8 + (4 if bf16 else 0)) * P) if stage == 0 else float(12 * P)
    per_rank = optimizer / world if stage >= 1 else 0.0
    model_file = weights + (optimizer if stage == 0 else 0.0)
    return {"weights": weights, "optimizer": optimizer, "optimizer_per_rank": per_rank, "model_file": model_file,
            "total": weights + optimizer}


def checkpoint_table(cfg, world: int) -> dict[str, Any]:
    """Checkpoint size on disk for ZeRO 0-3 in the config's precision, as configured, and the exports."""
    P = param_counts(cfg)["total"]
    bf16 = uses_bf16(cfg)
    rows = [{"stage": s, **checkpoint_bytes(P, stage=s, world=world, bf16=bf16)} for s in (0, 1, 2, 3)]
    return {"world": world, "bf16": bf16, "stages": rows, "configured": rows[zero_stage(cfg)],
            "keep_checkpoints": cfg.train.keep_checkpoints, "keep_every": cfg.train.keep_every,
            "export": {"fp32": float(4 * P), "bf16": float(2 * P)}}


# ----------------------------------------------------------------------------- the report

def size_report(cfg, *, gpus: int = 8, nodes: int = 1, rate: float | None = None,
                model=None) -> dict[str, Any]:
    """Everything megatok-model-size and ``pretrain.py --dry-run`` print. ``model``: an instantiated
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
        "checkpoint": checkpoint_table(cfg, world),
    }


def quiet_deepspeed_import() -> None:
    """Import DeepSpeed (load_config needs its ZeRO schema) with its start-up log line on stderr, so
    that stdout carries only the report (``--json`` output stays parseable)."""
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # noqa: F401


def positive(kind=int, most: float | None = None):
    """An argparse type: a number > 0 (and <= ``most``), or a one-line usage error."""
    return _number(kind, zero=False, most=most)


def non_negative(kind=int, note: str = ""):
    """An argparse type: a number >= 0, or a one-line usage error (``note``: what 0 means, added to it)."""
    return _number(kind, zero=True, note=note)


def _number(kind, zero: bool, most: float | None = None, note: str = ""):
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not (0 <= value if zero else 0 < value) or value == float("inf") or (most is not None and value > most):
            bound = f"{'>=' if zero else '>'} 0{f' and <= {most:g}' if most is not None else ''}"
            raise argparse.ArgumentTypeError(f"must be {bound}{note}, got {text}")
        return value

    return parse
