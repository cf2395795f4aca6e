"""The ``deepspeed`` config section: checked at load (:func:`check_deepspeed`), and completed with
what megatok derives from ``train`` into the dict handed to ``deepspeed.initialize``
(:func:`deepspeed_config`: batch sizes, AdamW, gradient clipping). Everything else in it (ZeRO stage,
offload, bf16, ...) is DeepSpeed's own JSON."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from megatok.errors import ConfigError, suggest

if TYPE_CHECKING:
    from megatok.config import Config

# Keys megatok writes into the DeepSpeed config from the ``train`` section.
DERIVED_DS_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "train.lr / train.betas / train.weight_decay",
    "scheduler": "train.warmup_steps / train.lr_schedule / train.min_lr_ratio (megatok's own, see lr_lambda)",
}
KNOWN_DS_KEYS = {
    "zero_optimization", "bf16", "fp16", "steps_per_print", "activation_checkpointing", "compile",
    "wall_clock_breakdown", "flops_profiler", "communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "checkpoint", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "aio", "comms_logger", "memory_breakdown", "data_types",
    "torch_autocast", "dump_state", "seq_parallel_communication_data_type", "tensorboard",
    "csv_monitor", "wandb", "comet", "timers",
}
# DeepSpeed features megatok does not run through DeepSpeed: accepted (runs that set them stay readable),
# with a warning at launch (config.warnings_for), and not handed to DeepSpeed's checks
NOT_THROUGH_DEEPSPEED = {
    "activation_checkpointing": "megatok recomputes blocks itself: set model.activation_checkpointing",
    "compile": "megatok compiles its blocks itself: set train.compile",
    "tensorboard": "megatok writes its metrics rows to TensorBoard itself: set logging.tensorboard",
}


def check_deepspeed(ds: dict[str, Any], where: str) -> None:
    """The user's section, before any process group: no derived keys, known keys only, ZeRO against
    DeepSpeed's own schema, bf16 (not fp16) as an object, then the whole section as DeepSpeed reads it
    (what ``deepspeed.initialize`` would refuse after the process group had started), less the keys
    megatok does not run through DeepSpeed (NOT_THROUGH_DEEPSPEED)."""
    for key in ds:
        if key in DERIVED_DS_KEYS:
            raise ConfigError(f"{where}: deepspeed.{key} is derived by megatok; set {DERIVED_DS_KEYS[key]} instead")
        if key not in KNOWN_DS_KEYS:
            raise ConfigError(f"{where}: deepspeed.{key}: unknown key{suggest(key, KNOWN_DS_KEYS, 'deepspeed.')}")
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: deepspeed.zero_optimization must be an object")
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # DeepSpeed's own schema
    except ImportError:  # a machine without DeepSpeed (e.g. megatok-gpu-check's plain-torch path)
        DeepSpeedZeroConfig = None
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"{where}: deepspeed.zero_optimization.stage must be 0, 1, 2 or 3 (got {json.dumps(stage)})")
    try:
        if DeepSpeedZeroConfig is not None:
            DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: deepspeed.zero_optimization.{loc}: {err['msg']}") from None
    for sec in ("bf16", "fp16"):
        if sec in ds and not isinstance(ds[sec], dict):
            raise ConfigError(f"{where}: deepspeed.{sec} must be an object like {{\"enabled\": true}}")
        if not isinstance(ds.get(sec, {}).get("enabled", False), bool):
            raise ConfigError(f"{where}: deepspeed.{sec}.enabled must be true or false "
                              f"(got {json.dumps(ds[sec]['enabled'])})")
    if ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{where}: deepspeed.fp16 is not supported (use bf16; byte-level losses overflow fp16)")
    every = ds.get("steps_per_print", 1)
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(f"{where}: deepspeed.steps_per_print must be a positive integer or null "
                          f"(got {json.dumps(every)})")
    if stage >= 2 and zero.get("reduce_scatter", True):  # DeepSpeed asserts this only when it builds ZeRO
        for key, bad in (("prescale_gradients", bool(ds.get("prescale_gradients", False))),
                         ("gradient_predivide_factor", ds.get("gradient_predivide_factor", 1.0) != 1.0)):
            if bad:
                raise ConfigError(f"{where}: deepspeed.{key}: DeepSpeed does not support it with ZeRO stage {stage} "
                                  f"and reduce_scatter (leave it out, or set "
                                  f"deepspeed.zero_optimization.reduce_scatter to false)")
    if DeepSpeedZeroConfig is not None:
        _check_with_deepspeed(ds, where)


def _check_with_deepspeed(ds: dict[str, Any], where: str) -> None:
    """DeepSpeed's own reading of the section (its sub-configs' schemas, removed keys, values), with
    placeholder batch keys: megatok checks the batch arithmetic itself, for the real world size."""
    import logging

    import torch
    from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum
    from deepspeed.utils import logger

    # no train_batch_size: DeepSpeed derives it for the world size it sees (1, or the process group's in a tool
    # that loads a config inside one)
    probe = {**{k: v for k, v in ds.items() if k not in NOT_THROUGH_DEEPSPEED},
             "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    level = logger.level
    logger.setLevel(logging.ERROR)  # it logs the world size it assumes
    accum = None
    try:
        read = DeepSpeedConfig(probe)
        if read.grad_accum_dtype is not None:  # read as given; the engine converts it only when it starts
            accum = DtypeEnum(read.grad_accum_dtype).value
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: deepspeed: {e.title}: {loc}: {err['msg']}") from None
    except Exception as e:  # noqa: BLE001 - DeepSpeed reports a bad value as many exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where}: deepspeed: DeepSpeed refuses the section: {first}") from None
    finally:
        logger.setLevel(level)
    model = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if accum is not None and accum != model and stage == 0:
        raise ConfigError(f"{where}: deepspeed.data_types.grad_accum_dtype: DeepSpeed accumulates in the model's "
                          f"dtype ({str(model).removeprefix('torch.')}) without ZeRO and refuses another at start; "
                          f"use ZeRO stage 2 or 3, or leave it out")
    if accum == torch.float32 and model == torch.bfloat16 and stage == 1:
        raise ConfigError(f"{where}: deepspeed.data_types.grad_accum_dtype: fp32 under bf16 and ZeRO stage 1 makes "
                          f"DeepSpeed train with its BF16 optimizer, whose checkpoints megatok's tools (export, "
                          f"evaluate, generate) cannot read; use ZeRO stage 2 or 3, or leave it out")


def zero_stage(cfg: Config) -> int:
    return int(cfg.deepspeed.get("zero_optimization", {}).get("stage", 0))


def builds_partitioned(cfg: Config) -> bool:
    """Whether the trainer builds the model under deepspeed.zero.Init (ZeRO-3 with train.zero_init)."""
    return zero_stage(cfg) == 3 and cfg.train.zero_init


def uses_bf16(cfg: Config) -> bool:
    return bool(cfg.deepspeed.get("bf16", {}).get("enabled", False))


def on_cuda() -> bool:
    """Whether DeepSpeed runs on CUDA: its accelerator as DS_ACCELERATOR names it, else CUDA when torch sees
    a GPU (DeepSpeed's own detection, without importing DeepSpeed)."""
    import os

    import torch

    return os.environ.get("DS_ACCELERATOR", "cuda") == "cuda" and torch.cuda.is_available()


def deepspeed_config(cfg: Config, world_size: int, fused_adam: bool | None = None) -> dict[str, Any]:
    """The dict handed to ``deepspeed.initialize``: the user's section plus the derived keys. ``fused_adam``
    (default: on CUDA, :func:`on_cuda`) makes torch's AdamW take its fused step (one kernel for all
    parameters instead of several per parameter); the CPU keeps the default step."""
    t = cfg.train
    ds = {k: v for k, v in json.loads(json.dumps(cfg.deepspeed)).items() if k not in NOT_THROUGH_DEEPSPEED}
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") == "cpu"
    fused = (on_cuda() if fused_adam is None else fused_adam) and not offload
    ds.update(
        train_batch_size=t.micro_batch_size * t.grad_accum * world_size,
        train_micro_batch_size_per_gpu=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        gradient_clipping=t.grad_clip,
        optimizer={
            "type": "AdamW",
            # torch's AdamW, except with the optimizer offloaded to the CPU, where DeepSpeed's CPU Adam is far
            # faster (it compiles a C++ op once; on a CPU-only machine torch's needs no compiler).
            "params": {"lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay,
                       "torch_adam": not offload, **({"fused": True} if fused else {})},
        },
    )
    ds.setdefault("steps_per_print", 10**9)
    return ds
