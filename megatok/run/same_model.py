"""Is a checkpoint the model a config builds? Every checkpoint records its parameters' shapes and the
digests of the files the model reads besides its weights (a tokenizer); a resume, an export or a tool
that loads a run checks them against the config, so a changed model or a tokenizer replaced at the
same path is named, not loaded. A resume also checks the ZeRO stage and precision it was written with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatok.boundaries import model_files as strategy_files
from megatok.boundaries.base import own_lr
from megatok.config import Config
from megatok.dsconfig import uses_bf16, zero_stage
from megatok.flops import build_meta_model
from megatok.run.checkpoints import META, CheckpointError, checkpoint_dir, parse_meta, restorable


def model_shapes(cfg: Config) -> dict[str, list[int]]:
    """Every parameter's full shape, from the model built on the meta device (no memory, any size)."""
    return {name: list(p.shape) for name, p in build_meta_model(cfg).named_parameters()}


def model_file_paths(cfg: Config) -> dict[str, str]:
    """The files a model reads besides its weights, by config key: a token model's ``model.tokenizer``,
    the boundary strategy's (megatok.boundaries.model_files: the bpe strategy's ``boundary.model_path``)."""
    if cfg.model.kind == "bpe":
        return {"model.tokenizer": cfg.model.tokenizer} if cfg.model.tokenizer else {}
    return {f"boundary.{name}": path for name, path in strategy_files(cfg.boundary).items() if path}


def model_files(cfg: Config) -> dict[str, str]:
    """:func:`model_file_paths`, each file's first 16 hex digits of its sha256. Recorded in every
    checkpoint, so that a tokenizer replaced at the same path is noticed, not used."""
    files = {key: Path(path) / "tokenizer.model" if Path(path).is_dir() else Path(path)  # as bpe.load_tokenizer
             for key, path in model_file_paths(cfg).items()}
    return {key: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for key, f in files.items() if f.is_file()}


def check_model_files(meta: dict, where: Path, cfg: Config) -> None:
    """A CheckpointError when a file the config points the model at is not the one the checkpoint
    (its metadata ``meta``, at ``where``) was trained with."""
    now, paths = model_files(cfg), model_file_paths(cfg)
    for key, digest in (meta.get("model", {}).get("model_files") or {}).items():
        if now.get(key, digest) != digest:
            raise CheckpointError(f"{where} was trained with another {key} than {paths[key]} holds now (sha256 "
                                  f"{digest}... then, {now[key]}... now: replaced since?); point {key} at the "
                                  f"file the run was trained with")


def _deepspeed_config(ckpt: Path) -> dict:
    """The DeepSpeed config a checkpoint was written with, as DeepSpeed saved it in its (rank 0's) model
    states file; {} when that does not read. Its tensors are mapped, not read."""
    import torch

    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (ckpt / name).is_file():
            try:
                state = torch.load(ckpt / name, map_location="cpu", mmap=True, weights_only=True)
                return dict(state.get("ds_config") or {})
            except Exception:  # noqa: BLE001 - another serialization, or damage, which resume_tag judges
                return {}
    return {}


def check_same_engine(meta: dict, ckpt: Path, cfg: Config, where: Path | None = None) -> None:
    """A CheckpointError, naming the keys and both values, when ``cfg`` trains under another ZeRO stage
    (``zero_stage`` in the engine's part of the checkpoint's metadata ``meta``), precision (``precision``) or
    number of optimizer groups (:func:`check_same_optimizer_groups`) than the
    checkpoint at ``ckpt`` (named ``where``, default ``ckpt``) was written with: DeepSpeed cannot load the one's states into the other, and
    fails late, after the process group started, with errors that read like damage or a bug. ZeRO
    stages 1 and 2 write the same files and resume each other. For a checkpoint written before the
    precision was recorded, it is read from the DeepSpeed config saved in DeepSpeed's files."""
    engine = meta.get("engine", {})
    precision = engine.get("precision")
    if precision is None:
        bf16 = _deepspeed_config(ckpt).get("bf16", {}).get("enabled")
        precision = None if bf16 is None else "bf16" if bf16 else "fp32"
    saved_stage, stage = engine.get("zero_stage"), zero_stage(cfg)
    differ = []
    if saved_stage is not None and saved_stage != stage and {saved_stage, stage} != {1, 2}:
        differ.append(f"deepspeed.zero_optimization.stage: {saved_stage} in the checkpoint, {stage} now")
    if precision is not None and (precision == "bf16") != uses_bf16(cfg):
        differ.append(f"deepspeed.bf16.enabled: {json.dumps(precision == 'bf16')} in the checkpoint, "
                      f"{json.dumps(uses_bf16(cfg))} now")
    if differ:
        what = "another DeepSpeed setting" if len(differ) == 1 else "other DeepSpeed settings"
        raise CheckpointError(f"{where or ckpt} was written under {what} than the config's "
                              f"({'; '.join(differ)}), which DeepSpeed cannot resume; set the config back, or "
                              f"use another train.run_dir, or --resume none to start over (the old run is set "
                              f"aside)")
    check_same_optimizer_groups(engine.get("optimizer_groups", 2), cfg, where or ckpt)  # 2: before it was recorded


def optimizer_groups(cfg) -> int:
    """How many optimizer groups megatok.train.engine.param_groups makes for the model ``cfg`` builds (4
    where its boundary strategy sets its own learning rate, else 2), from the model on the meta device."""
    return 4 if own_lr(build_meta_model(cfg)) else 2


def check_same_optimizer_groups(groups: int, cfg: Config, where: Path) -> None:
    """A CheckpointError when the checkpoint at ``where`` was trained with ``groups`` optimizer groups and ``cfg``
    makes another number: the policy's own learning rate (boundary.lr_scale, start_step, lr_warmup_steps)
    gives its parameters groups of their own, and DeepSpeed cannot resume the one optimizer in the other."""
    now = optimizer_groups(cfg)
    if groups == now:
        return
    o = cfg.boundary.options
    if groups < now:
        raise CheckpointError(f"{where} was trained with the boundary policy's parameters in the model's optimizer "
                              f"groups (boundary.lr_scale 1, start_step 0, lr_warmup_steps 0, lr_hold false: the "
                              f"published setting, the default before 2026-12-07) and the config gives them their "
                              f"own learning rate (lr_scale {o.lr_scale:g}, start_step {o.start_step}, lr_warmup_steps "
                              f"{o.lr_warmup_steps}, lr_hold {str(o.lr_hold).lower()}), which DeepSpeed cannot "
                              f"resume; set boundary.lr_scale=1.0, start_step=0, lr_warmup_steps=0 and lr_hold=false "
                              f"to resume it, or use another train.run_dir")
    raise CheckpointError(f"{where} was trained with the boundary policy's own learning rate (its parameters in "
                          f"optimizer groups of their own) and the config gives it none (boundary.lr_scale 1, "
                          f"start_step 0, lr_warmup_steps 0, lr_hold false), which DeepSpeed cannot resume; set them "
                          f"as the run was trained (its config.json), or use another train.run_dir")


def check_same_model(run_dir: str | Path, tag: str, cfg: Config) -> None:
    """A CheckpointError, naming what changed, when ``cfg`` builds another model than checkpoint ``tag``
    holds (its ``param_shapes``), points it at another tokenizer file (:func:`check_model_files`), or
    trains it under another ZeRO stage, precision or optimizer groups (:func:`check_same_engine`): what a
    resume checks, before any process group."""
    ckpt = restorable(run_dir, tag)  # where resume_tag found it
    meta = parse_meta((ckpt / META).read_text())
    check_model_files(meta, checkpoint_dir(run_dir) / tag, cfg)
    saved, now = meta.get("model", {}).get("param_shapes"), model_shapes(cfg)
    if saved is None:
        raise CheckpointError(f"{checkpoint_dir(run_dir) / tag}: its {META} records no param_shapes: not a checkpoint "
                              f"megatok's trainer wrote")
    if saved == now:
        check_same_engine(meta, ckpt, cfg, checkpoint_dir(run_dir) / tag)
        return
    differ = [n for n in sorted(set(saved) | set(now)) if saved.get(n) != now.get(n)]
    first = differ[0]
    what = (f"{len(differ)} parameter(s) differ, e.g. {first}: {saved.get(first, 'absent')} in the checkpoint, "
            f"{now.get(first, 'absent')} now")
    try:  # the config keys behind it, from the config the run last started with
        before = json.loads((Path(run_dir) / "config.json").read_text())
        after = cfg.to_dict()
        keys = [f"{sec}.{k}: {json.dumps(before[sec].get(k))} -> {json.dumps(after[sec].get(k))}"
                for sec in ("model", "boundary") for k in sorted(set(before.get(sec, {})) | set(after[sec]))
                if before.get(sec, {}).get(k) != after[sec].get(k)]
        if keys:
            what += f" ({'; '.join(keys[:4])}{'; ...' if len(keys) > 4 else ''})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    raise CheckpointError(f"{checkpoint_dir(run_dir) / tag} holds another model than the config builds: {what}; "
                          f"set the config back, or use another train.run_dir, or --resume none to start over "
                          f"(the old run is set aside)")
