"""Typed run configuration: JSON files -> validated dataclass-like objects.

A config is a JSON object with the sections below. A file may start from another one with
``"extends": "base.json"`` (resolved next to the file; objects merge key by key). Command-line
overrides use dotted keys (``train.max_steps=20``) and are typed by the schema. Every mistake
raises :class:`ConfigError` with one line naming the file and the full key path, and it happens
before any process group starts.

The ``deepspeed`` section is DeepSpeed's own JSON (ZeRO stage, offload, bf16, ...); megatok.dsconfig
checks it and adds what megatok derives from ``train``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer,
                      model_validator)
from pydantic_core import PydanticCustomError

from megatok.boundaries import check_config, strategy_options
from megatok.dsconfig import NOT_THROUGH_DEEPSPEED, check_deepspeed
from megatok.errors import ConfigError, suggest


def _allows(annotation, kind: type) -> bool:
    """Whether a field's annotation (int, int | None, str | list[str], ...) takes values of ``kind``."""
    if annotation is kind:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_allows(a, kind) for a in typing.get_args(annotation))
    return False


def whole_floats_as_ints(model: type[BaseModel], data: Any) -> Any:
    """JSON has one number type, so ``"max_steps": 1e5`` is a float: an integer field takes a whole one."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, field in model.model_fields.items():
        v = out.get(name)
        if isinstance(v, float) and v.is_integer() and _allows(field.annotation, int) and not _allows(
                field.annotation, float):
            out[name] = int(v)
    return out


class _Section(BaseModel):
    """Strict: "5" is not a number, "yes" and 1 are not booleans (pydantic's default would coerce them)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _whole_floats(cls, data: Any) -> Any:
        return whole_floats_as_ints(cls, data)


class ModelConfig(_Section):
    kind: Literal["unet", "bpe"] = Field("unet", description="unet: megatok's byte model; bpe: the baseline token model (n_main_layers blocks of the main width over sentencepiece ids)")
    d_model: int = Field(256, gt=0, description="width of the byte-rate encoder and decoder")
    n_heads: int = Field(4, gt=0, description="attention heads at byte rate")
    n_encoder_layers: int = Field(1, ge=0, description="byte-rate layers before the boundaries")
    n_main_layers: int = Field(2, gt=0, description="chunk-rate layers (most parameters belong here)")
    n_decoder_layers: int = Field(1, ge=0, description="byte-rate layers after upsampling")
    byte_window: int | None = Field(None, gt=0, description="the byte-rate layers (encoder and decoder) attend to the "
                                    "last byte_window bytes only (sliding-window attention; default: every earlier byte)")
    d_main: int | None = Field(None, gt=0, description="width of the main network (default d_model)")
    n_main_heads: int | None = Field(None, gt=0, description="heads in the main network (default n_heads)")
    ffn_multiple_of: int = Field(64, gt=0, description="SwiGLU hidden size is rounded up to a multiple of this")
    ffn_mult: float = Field(8 / 3, gt=0, description="SwiGLU hidden size = ffn_mult x width")
    rope_theta: float = Field(10000.0, gt=0, description="rotary base; the main network rotates by the byte position of each chunk start")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    init_std: float = Field(0.02, gt=0, description="std of weight init (output projections scaled by 1/sqrt(2 x layers))")
    early_exit_weight: float = Field(0.1, ge=0, lt=1, description="LM loss = (1-w) CE_full + w CE_early")
    activation_checkpointing: bool = Field(False, description="recompute each block in backward (torch.utils.checkpoint)")
    document_mask: bool = Field(False, description="packed documents never see each other: attention stops at every SEP (bpe: the tokenizer's eos id), a chunk starts at every SEP, policy returns stop there")
    tokenizer: str | None = Field(None, description="bpe: tokenizer.model (or its directory) from megatok-train-bpe")
    vocab_size: int | None = Field(None, gt=0, description="bpe: embedding rows, at least the tokenizer's pieces (round up to a multiple of 64)")
    bytes_per_token: float | None = Field(None, gt=0, description="bpe: expected bytes per token of the training data (megatok-train-bpe reports it), for FLOPs per byte before training")
    chunk_capacity: float | None = Field(None, gt=0, le=1, description="the most chunks per byte the main network holds: its length never exceeds this x data.seq_len (rounded up to one of 8 sizes per octave), whatever rate the boundaries reach, so its memory is bounded (megatok-model-size sizes it); a row with more starts joins its last ones to the chunk before them. None: as many as the batch's busiest row. (unet only; a bpe model ignores it)")
    static_chunks: bool = Field(False, description="with chunk_capacity: the main network's length is always the capacity's, known without reading the boundaries (no device-to-host sync per forward), at the cost of computing the pad chunks up to it")
    pack_chunks: float | None = Field(None, ge=1, le=8, description="the micro-batch's chunks packed across its rows into one sequence for the main network, of a fixed length: boundary.target_rate x rows x data.seq_len x this slack, rounded up to one of 8 sizes per octave; rows and documents kept apart by the attention mask, no device-to-host sync; starts past the length are dropped on the device (each row's last ones first) and counted (dropped_start_fraction), the policy's log-probabilities those of the decisions taken (megatok.model.chunking.pack). None: a [rows, chunks] layout")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        bpe_keys = ("tokenizer", "vocab_size", "bytes_per_token")
        if self.kind == "bpe":
            missing = [k for k in bpe_keys if getattr(self, k) is None]
            if missing:
                raise ValueError(f"model.kind 'bpe' needs model.{', model.'.join(missing)} (megatok-match-bpe writes "
                                 "a complete config)")
            if self.byte_window is not None:
                raise ValueError("model.byte_window is for the byte model's byte-rate layers; model.kind 'bpe' has none")
            for k in ("n_encoder_layers", "n_decoder_layers"):
                if getattr(self, k):
                    raise ValueError(f"model.{k} must be 0 for model.kind 'bpe' (the token model is n_main_layers "
                                     "blocks of the main width)")
        else:
            given = [k for k in bpe_keys if getattr(self, k) is not None]
            if given:
                raise ValueError(f"model.{given[0]} is only for model.kind 'bpe'")
        if self.static_chunks and self.chunk_capacity is None:
            raise ValueError("model.static_chunks needs model.chunk_capacity (the length it fixes)")
        if self.pack_chunks is not None and self.chunk_capacity is not None:
            raise ValueError("model.pack_chunks fixes the main network's length itself: leave model.chunk_capacity and "
                             "model.static_chunks unset")
        width_default = "" if self.d_main else ", default model.d_model"
        heads_default = "" if self.n_main_heads else ", default model.n_heads"
        main = (f"the main network's width {self.main_width} (model.d_main{width_default})",
                f"its {self.main_heads} heads (model.n_main_heads{heads_default})")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.main_width % self.main_heads:
            raise ValueError(f"{main[0]} is not divisible by {main[1]}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model.d_model={self.d_model} / model.n_heads={self.n_heads} = "
                             f"{self.d_model // self.n_heads}: rotary embeddings need an even head dimension")
        if (self.main_width // self.main_heads) % 2:
            raise ValueError(f"{main[0]} / {main[1]} = {self.main_width // self.main_heads}: rotary embeddings need an "
                             f"even head dimension")
        return self

    @property
    def main_width(self) -> int:
        return self.d_main or self.d_model

    @property
    def main_heads(self) -> int:
        return self.n_main_heads or self.n_heads


class BoundaryConfig(_Section):
    """``strategy`` names a file in megatok/boundaries/; its other keys are that strategy's options, read
    strictly like the sections into the strategy's own ``Options`` (``options``; unknown keys rejected) and
    written back as keys of this section."""

    strategy: str = Field("policy", description="a file in megatok/boundaries/: policy, fixed, ...")
    target_rate: float = Field(0.2, gt=0, lt=1, description="boundaries per byte (rho)")
    options: BaseModel = Field(None, exclude=True, description="the strategy's Options instance")

    @model_validator(mode="wrap")
    @classmethod
    def _read_options(cls, data: Any, handler) -> "BoundaryConfig":
        """The keys besides strategy and target_rate are the strategy's options: read into its Options after
        those two are (so their mistakes are named first); or, given as an Options (a copy, an assignment),
        checked to be the strategy's."""
        if not isinstance(data, dict) or isinstance(data.get("options"), BaseModel):
            section = handler(data)
            try:
                model = strategy_options(section.strategy)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
            if not isinstance(section.options, model):
                raise ValueError(f"the options are another strategy's, not those of '{section.strategy}' (set the "
                                 f"section whole)")
            return section
        data = dict(data)
        raw = {k: data.pop(k) for k in list(data) if k not in config_keys(cls)}
        section = handler(data)
        section.options = _read_strategy_options(section.strategy, raw)
        return section

    @model_serializer(mode="wrap")
    def _options_as_keys(self, handler, info) -> dict[str, Any]:
        return {**handler(self), **self.options.model_dump(mode=info.mode)}


def config_keys(model: type[BaseModel]) -> list[str]:
    """The keys a section takes in a config file (``boundary.options`` is not one: its fields are)."""
    return [name for name, f in model.model_fields.items() if not f.exclude]


@functools.cache
def _strict(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` read strictly like the sections (a field's own strict=False, e.g. for a tuple read from a
    JSON list, wins)."""
    return type(model.__name__, (model,), {"__module__": model.__module__,
                                           "model_config": {**model.model_config, "strict": True}})


def _read_strategy_options(strategy: str, raw: dict) -> BaseModel:
    """The strategy's Options from a boundary section's other keys, or a pydantic error naming the key
    (``strategy_option``, which load_config turns into one line)."""
    try:
        model = strategy_options(strategy)
    except KeyError as e:
        raise PydanticCustomError("strategy_option", "{text}", {"key": "strategy", "text": e.args[0]}) from None
    try:
        read = _strict(model).model_validate(whole_floats_as_ints(model, raw))
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        valid = config_keys(BoundaryConfig) + list(model.model_fields)
        text = (f"unknown key for strategy '{strategy}'{suggest(key, valid, 'boundary.')}"
                if err["type"] == "extra_forbidden" else _message(err))
        raise PydanticCustomError("strategy_option", "{text}", {"key": key, "text": text}) from None
    return model.model_construct(_fields_set=read.model_fields_set, **dict(read))  # the strategy's own class


class DataConfig(_Section):
    shards: str | list[str] | dict[str, float] = Field(
        "data/shards", description="build_shards directory or WebDataset URLs; or a mixture {shards: weight}, "
                                   "read in proportion to the weights by bytes")
    val_shards: str | list[str] | dict[str, float] | None = Field(
        None, description="default: the val split of data.shards (of each source of a mixture, by weight)")
    seq_len: int = Field(512, gt=1, description="bytes per training sequence (tokens for model.kind bpe)")
    num_workers: int = Field(1, ge=0, description="dataloader worker processes per rank (0: read in the training process)")
    on_bad_shard: Literal["warn", "error"] = Field("warn", description="a corrupt/empty shard: skip it with a warning, or stop")

    @field_validator("shards", "val_shards", mode="before")
    @classmethod
    def _mixture(cls, v):
        if v is None:
            return v
        if not (isinstance(v, (str, dict)) or isinstance(v, list) and all(isinstance(u, str) for u in v)):
            raise ValueError("expected a shard directory or URL pattern, a list of them, or a {source: weight} "
                             "mixture")
        if isinstance(v, (list, str)) and (not v or not all(u.strip() for u in ([v] if isinstance(v, str) else v))):
            raise ValueError("names no shards" if not v or isinstance(v, str) else "an empty shard name")
        if isinstance(v, dict):
            if not v:
                raise ValueError("a mixture needs at least one source")
            for source, w in v.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
                    raise ValueError(f"the weight of source {source!r} must be a positive finite number, not {w!r}")
        return v


class TrainConfig(_Section):
    run_dir: str = Field("runs/tiny", description="config.json, metrics.jsonl, checkpoints/, wandb/ go here")
    max_steps: int = Field(200, gt=0, description="optimizer steps")
    schedule_steps: int | None = Field(None, gt=0, description="the steps the learning-rate schedule spans (default: "
                                       "max_steps); more than max_steps ends the run part way through its schedule, "
                                       "e.g. the first phase of a hand-over")
    micro_batch_size: int = Field(8, gt=0, description="sequences per rank per forward")
    grad_accum: int | None = Field(None, gt=0, description="default: global_batch_size / (micro x world), else 1")
    global_batch_size: int | None = Field(None, gt=0, description="checked: micro x accum x world size")
    lr: float = Field(1.5e-3, gt=0, description="peak AdamW learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine and wsd decay to lr x this at the schedule's "
                                "end (max_steps, or schedule_steps)")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps, then lr_schedule")
    lr_schedule: Literal["cosine", "wsd", "constant"] = Field(
        "cosine", description="after warmup: cosine decay to max_steps; wsd (warmup-stable-decay) = constant, "
                              "then linear decay over the last decay_steps; constant")
    decay_steps: int | None = Field(None, gt=0, description="wsd: steps of the final decay (default: 20% of max_steps)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decay on matrices (not norms or biases)")
    betas: tuple[float, float] = Field((0.9, 0.95), strict=False,  # a JSON list is not a tuple
                                       description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm (0: off)")
    seed: int = Field(0, ge=0, description="init, data order and boundary sampling")
    init_from: str | None = Field(None, description="a run directory (its latest checkpoint) or RUN/checkpoints/TAG "
                                  "whose weights start this run at step 0 (new optimizer, schedule and data order): "
                                  "parameters of the same name are copied, the others keep their initial values "
                                  "(docs/training.md#starting-from-another-runs-weights); a resume ignores it")
    log_every: int = Field(10, gt=0, description="steps between metrics rows (checkpoint and evaluation steps get one too)")
    save_every: int = Field(100, gt=0, description="steps between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept in RUN_DIR/checkpoints")
    keep_every: int | None = Field(None, gt=0, description="also keep, for good, every checkpoint whose step is a "
                                                          "multiple of this (a multiple of save_every): for the "
                                                          "head-to-head's matched baseline checkpoints, or analysis")
    max_skipped_steps: int = Field(10, ge=0, description="abort after this many optimizer steps in a row skipped for non-finite gradients")
    dist_timeout_s: float = Field(600.0, gt=0, description="collectives that take longer fail instead of hanging")
    save_timeout_s: float | None = Field(None, gt=0, description="how long one checkpoint save may take before the "
                                                               "watchdog ends the run (default: dist_timeout_s); "
                                                               "the process-group timeout is the larger of the two")
    peak_tflops: float | None = Field(None, gt=0, description="dense TFLOP/s of one device for the mfu column (default: the GPU's bf16 peak by name, megatok.flops.PEAK_BF16_TFLOPS; no mfu on a CPU)")
    zero_init: bool = Field(True, description="ZeRO-3: build the model already partitioned over the ranks "
                                              "(deepspeed.zero.Init), so no rank holds it whole")
    deterministic: bool = Field(False, description="deterministic kernels (torch.use_deterministic_algorithms, a fixed "
                                "cuBLAS workspace): on a GPU a resume repeats the losses bit for bit, at a cost "
                                "megatok-gpu-check measures; a kernel with no deterministic version fails, named")
    compile: bool | Literal["blocks", "model"] = Field(
        False, description="true or 'blocks': torch.compile every transformer block (dynamic shapes: the number of "
                           "chunks changes from batch to batch); 'model': the whole training forward (byte layers, "
                           "policy, packed main network, heads, losses, discounted returns) as one graph with no "
                           "break, no recompile as the step moves (needs model.pack_chunks; ZeRO 0-2); the first "
                           "steps compile")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_are_numbers(cls, v):
        if isinstance(v, (list, tuple)) and any(isinstance(b, (bool, str)) for b in v):
            raise ValueError("betas are two numbers, like [0.9, 0.95]")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v

    @property
    def collective_timeout_s(self) -> float:
        """The process group's timeout: a collective may wait out the slowest rank's checkpoint save."""
        return max(self.dist_timeout_s, self.save_timeout_s or 0.0)


class EvalConfig(_Section):
    every: int = Field(100, ge=0, description="validation every N steps (0: only at the end)")
    max_sequences: int = Field(64, gt=0, description="validation sequences, split over ranks")
    batch_size: int | None = Field(None, gt=0, description="default: train.micro_batch_size")
    boundary_mode: Literal["sample", "threshold"] = Field("sample", description="validation boundaries: seeded samples, or p > 0.5")
    seed: int = Field(1234, ge=0, description="sampling seed for validation boundaries")
    heldout: str | list[str] | None = Field(None, description="head-to-head documents with lang/domain (a .jsonl, files, or a shard directory's val split); default: the validation split")
    heldout_max_bytes: int = Field(262144, gt=0, description="head-to-head: bytes of heldout scored (whole documents, every (lang, domain) group of a heldout file in turn)")
    baseline_run: str | None = Field(None, description="head-to-head: a run directory (usually the BPE token model) whose checkpoint is scored on the same bytes at every eval")
    baseline_checkpoint: Literal["matched", "latest"] = Field("matched", description="head-to-head: the baseline's checkpoint nearest to this run in training bytes, or its latest")
    bpe_tokenizer: str | None = Field(None, description="head-to-head: tokenizer whose bytes/token is reported (default: baseline_run's, if it is a bpe run)")

    @property
    def head_to_head(self) -> bool:
        """Per-language head-to-head evaluation runs at every eval when any of its inputs is set."""
        return any(v is not None for v in (self.heldout, self.baseline_run, self.bpe_tokenizer))


class LoggingConfig(_Section):
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="offline logs under RUN_DIR/wandb (wandb sync to upload)")
    wandb_project: str = Field("megatok", description="wandb project")
    wandb_entity: str | None = Field(None, description="wandb team or user")
    wandb_name: str | None = Field(None, description="wandb run name (default: the run directory's name); the id adds a hash of the directory's path")
    wandb_group: str | None = Field(None, description="wandb group: runs of one study or sweep together (megatok-replicate "
                                    "and megatok-sweep set it)")
    wandb_tags: list[str] = Field(default_factory=list, description="wandb tags (megatok-replicate sets the method, "
                                  "the seed and the level; megatok-sweep the size and the strategy)")
    tensorboard: bool = Field(False, description="rank 0 also writes every metrics row's figures as TensorBoard scalars "
                              "under RUN_DIR/tensorboard, named as in wandb (train/loss, val/val_bpb, h2h/...): "
                              "tensorboard --logdir RUN_DIR/tensorboard")
    progress: bool = Field(True, description="on rank 0, a progress bar when stderr is a terminal; otherwise "
                                             "(a job's log file) one line on stdout per training row: step, the time, the "
                                             "time trained and an estimate of what is left, loss, "
                                             "bpb, boundary rate, lr, bytes/s, MFU (TFLOP/s per device where the "
                                             "peak is unknown) and peak memory")
    profile_steps: list[int] | None = Field(
        None, description="[start, stop]: torch.profiler records optimizer steps start to stop - 1 (the steps of "
                          "metrics.jsonl, 1-based) and writes one Chrome trace per rank to "
                          "RUN_DIR/profile/steps<start>-<stop>-rank<r>.json (open in Perfetto or chrome://tracing)")

    @field_validator("profile_steps")
    @classmethod
    def _profile_window(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) != 2 or not 1 <= v[0] < v[1]):
            raise ValueError("expected [start, stop] with 1 <= start < stop: the profiler records steps start to "
                             "stop - 1")
        return v


class Config(_Section):
    model: ModelConfig = ModelConfig()
    boundary: BoundaryConfig = Field(default_factory=BoundaryConfig)  # built when used: no strategy imported here
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    deepspeed: dict[str, Any] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def schedule_steps(t: "TrainConfig") -> int:
    """The steps the learning-rate schedule spans: train.schedule_steps, by default train.max_steps."""
    return t.schedule_steps if t.schedule_steps is not None else t.max_steps


def wsd_decay_steps(t: "TrainConfig") -> int:
    """The steps of the wsd schedule's final decay: train.decay_steps, by default 20% of the schedule's steps."""
    return t.decay_steps if t.decay_steps is not None else max(1, round(0.2 * schedule_steps(t)))


def lr_lambda(cfg: Config):
    """Multiplier of train.lr for optimizer step s (0-based): linear warmup to 1 over warmup_steps
    (the first step already trains, at lr / warmup_steps), then by train.lr_schedule: cosine down to
    min_lr_ratio at the schedule's end (schedule_steps, by default max_steps); wsd: 1, then over the last
    decay_steps linear down to min_lr_ratio (reached at the schedule's last step); constant: 1."""
    t = cfg.train
    warmup, total, floor = t.warmup_steps, schedule_steps(t), t.min_lr_ratio
    decay_start = total - wsd_decay_steps(t)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if t.lr_schedule == "constant":
            return 1.0
        if t.lr_schedule == "wsd":
            return 1 - (1 - floor) * min(1.0, max(0, s + 1 - decay_start) / (total - decay_start))
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# --------------------------------------------------------------------------- loading


def merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``, objects merged key by key (as ``extends`` merges a file over its parent)."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_json(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    if path in chain:
        raise ConfigError(f"{chain[0]}: 'extends' forms a cycle through {path}")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save the "
                          f"config as UTF-8") from None
    except FileNotFoundError:
        where = f"{chain[-1]}: extends" if chain else "config"
        raise ConfigError(f"{where}: file not found: {path}") from None
    except IsADirectoryError:
        where = f"{chain[-1]}: extends" if chain else "config"
        raise ConfigError(f"{where}: {path} is a directory, not a JSON config") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: 'extends' must be a file name")
    return merge(_read_json((path.parent / parent).resolve(), chain + (path,)), raw)


def _field_annotation(keys: list[str]):
    """The pydantic annotation at a dotted path, or None where the schema is open (deepspeed, options)."""
    model: Any = Config
    for k in keys:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or k not in model.model_fields:
            return None
        model = model.model_fields[k].annotation
    return model


def overrides_dict(overrides: list[str]) -> dict:
    """``--set KEY=VALUE`` items as the nested config dict they stand for, each value typed by the schema
    (as load_config applies them)."""
    raw: dict = {}
    for item in overrides:
        _apply_override(raw, *_parse_override(item))
    return raw


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected KEY=VALUE, for example train.max_steps=20")
    key, text = item.split("=", 1)
    keys = key.strip().split(".")
    ann = _field_annotation(keys)
    if ann is str:
        return keys, text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return keys, text  # a plain string; the schema decides whether that is allowed
    return keys, text if _number_for_text(ann, value) else value


def _number_for_text(annotation, value) -> bool:
    """A --set number or boolean for a key that takes text and not that (logging.wandb_name=1 names the
    run "1")."""
    return isinstance(value, (bool, int, float)) and _allows(annotation, str) and not _allows(annotation, type(value))


def _apply_override(raw: dict, keys: list[str], value: Any) -> None:
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: '{k}' is not a section")
    node[keys[-1]] = value


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Config
    for k in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or k not in model.model_fields:
            return None
        model = model.model_fields[k].annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")  # pydantic's tag of a union member in a loc


def _first_error(errors: list[dict]) -> dict:
    """The first failing key's error; for a union-typed key (str | list[str] | ...), the member that got
    furthest (``eval.heldout.0: ... valid string`` rather than ``eval.heldout.str``), its tag dropped."""
    first = errors[0]
    same = [e for e in errors if e["loc"][:2] == first["loc"][:2]]
    err = max(same, key=lambda e: len(e["loc"]))
    loc = tuple(p for i, p in enumerate(err["loc"]) if i < 2 or not (isinstance(p, str) and _UNION_MEMBER.match(p)))
    return {**err, "loc": loc}


def _message(err: dict) -> str:
    """A pydantic error's message and the value it got (a section's own check, given the whole section, names
    its keys and values itself)."""
    given = err.get("input")
    if isinstance(given, dict) and err["type"] == "value_error":
        return err["msg"].removeprefix("Value error, ")
    shown = (json.dumps(given, default=str) if isinstance(given, (int, float, str, bool, type(None))) or (
        isinstance(given, (list, tuple)) and len(json.dumps(given, default=str)) <= 80) else type(given).__name__)
    return f"{err['msg'].removeprefix('Value error, ')} (got {shown})"


def _explain(err: dict, where: str) -> ConfigError:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc)
    if err["type"] == "strategy_option":  # _read_strategy_options: the key and the line are in the error
        return ConfigError(f"{where}: {'.'.join(p for p in (path, err['ctx']['key']) if p)}: {err['ctx']['text']}")
    if err["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        valid = config_keys(parent) if parent else []
        section = ".".join(str(p) for p in loc[:-1])
        return ConfigError(f"{where}: {path}: unknown key{suggest(loc[-1], valid, section + '.' if section else '')}")
    message = _message(err)
    return ConfigError(f"{where}: {message}" if f"{path}." in message else f"{where}: {path}: {message}")


# megatok's own configs: configs/ next to the package in a checkout, inside it when installed (pyproject.toml
# installs configs/ as the package data megatok/configs).
_PACKAGE = Path(__file__).resolve().parent
CONFIGS = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"


def find_config(path: str | os.PathLike) -> Path:
    """``path``; or, where no such file is here and it is spelled ``configs/NAME.json`` as megatok's
    documentation spells its configs, megatok's own copy (CONFIGS): ``--config configs/1b.json`` works
    from any directory once megatok is installed."""
    p = Path(path)
    if not p.exists() and not p.is_absolute() and p.parts[:1] == ("configs",) and len(p.parts) > 1:
        own = CONFIGS.joinpath(*p.parts[1:])
        if own.is_file():
            return own
    return p


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = (), *,
                world_size: int | None = None, world_from: str | None = None) -> Config:
    """Read, merge, override, validate. ``world_size`` defaults to $WORLD_SIZE (set by launchers) or 1;
    ``world_from``: where a tool took it from (e.g. "--gpus 8, the default"), named where it matters."""
    where = str(path) if path is not None else "config"
    raw = _read_json(find_config(path).resolve()) if path is not None else {}
    for item in overrides:
        _apply_override(raw, *_parse_override(item))
    if overrides:
        where += " (with --set " + " ".join(overrides) + ")"
    _strategy_text_options(raw, overrides)
    _check_finite(raw, where)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise _explain(_first_error(e.errors()), where) from None
    check_deepspeed(cfg.deepspeed, where)
    _check_derived(cfg, where, world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")),
                   world_from)
    return cfg


def _check_finite(raw: Any, where: str, path: str = "") -> None:
    """A ConfigError naming the key of the first number that is not finite (JSON's NaN and Infinity, which
    Python's reader takes, or a literal such as 1e400 that overflows): no setting means infinity."""
    if isinstance(raw, dict):
        for k, v in raw.items():
            key = f".{k}" if re.fullmatch(r"[A-Za-z_]\w*", str(k)) else f"[{json.dumps(k)}]"  # a mixture's source
            _check_finite(v, where, f"{path}{key}" if path else str(k))
    elif isinstance(raw, list):
        for i, v in enumerate(raw):
            _check_finite(v, where, f"{path}[{i}]")
    elif isinstance(raw, float) and not math.isfinite(raw):
        raise ConfigError(f"{where}: {path}: {raw} is not a finite number")


def _strategy_text_options(raw: dict, overrides: list[str]) -> None:
    """The strategy's text options take --set numbers as text, as the sections' do (the strategy is known
    once every override is in)."""
    section = raw.get("boundary")
    strategy = section.get("strategy", BoundaryConfig.model_fields["strategy"].default) if isinstance(
        section, dict) else None
    try:
        fields = strategy_options(strategy).model_fields if isinstance(strategy, str) else {}
    except KeyError:
        return  # reported when the section is read
    for item in overrides:
        keys, value = _parse_override(item)
        if len(keys) == 2 and keys[0] == "boundary" and keys[1] in fields and _number_for_text(
                fields[keys[1]].annotation, value):
            section[keys[1]] = item.split("=", 1)[1]


def warnings_for(cfg: Config) -> list[str]:
    """Settings that are valid but probably not meant (a smoke test may mean them): one line each."""
    t, out = cfg.train, []
    if t.warmup_steps >= t.max_steps:
        out.append(f"train.warmup_steps={t.warmup_steps} is not below train.max_steps={t.max_steps}: the run ends "
                   f"before its warmup does (or as it does), so train.lr_schedule never takes over")
    out += [f"deepspeed.{k} does nothing here: {why}" for k, why in NOT_THROUGH_DEEPSPEED.items() if k in cfg.deepspeed]
    return out


def _check_derived(cfg: Config, where: str, world_size: int, world_from: str | None = None) -> None:
    t = cfg.train
    world = f"world size ({world_size}{', from ' + world_from if world_from else ''})"
    per_step = t.micro_batch_size * world_size
    if t.grad_accum is None:
        if t.global_batch_size is not None and t.global_batch_size % per_step:
            raise ConfigError(
                f"{where}: train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size"
                f" ({t.micro_batch_size}) x {world}; for this many ranks lower train.micro_batch_size "
                f"or raise train.global_batch_size")
        t.grad_accum = t.global_batch_size // per_step if t.global_batch_size is not None else 1
    total = per_step * t.grad_accum
    if t.global_batch_size is not None and t.global_batch_size != total:
        hint = ""
        if t.global_batch_size % per_step == 0:  # e.g. a run's config.json, which records the accumulation it derived
            hint = (f"; --set train.grad_accum=null derives it for this world size "
                    f"({t.global_batch_size // per_step})")
        raise ConfigError(
            f"{where}: train.global_batch_size={t.global_batch_size} but train.micro_batch_size ({t.micro_batch_size})"
            f" x train.grad_accum ({t.grad_accum}) x {world} = {total}{hint}")
    if t.schedule_steps is not None and t.schedule_steps < t.max_steps:
        raise ConfigError(f"{where}: train.schedule_steps={t.schedule_steps} is below train.max_steps ({t.max_steps}): "
                          f"the schedule would end before the run does; raise it, or leave it out (it defaults to "
                          f"max_steps)")
    if t.lr_schedule == "wsd" and wsd_decay_steps(t) > schedule_steps(t) - t.warmup_steps:
        span = "schedule_steps" if t.schedule_steps is not None else "max_steps"
        given = "" if t.decay_steps is not None else f" (the default, 20% of {span})"
        raise ConfigError(f"{where}: train.decay_steps={wsd_decay_steps(t)}{given} is more than train.{span} "
                          f"({schedule_steps(t)}) - train.warmup_steps ({t.warmup_steps}): the decay would "
                          f"overlap the warmup")
    if t.decay_steps is not None and t.lr_schedule != "wsd":
        raise ConfigError(f"{where}: train.decay_steps is only for train.lr_schedule 'wsd' (it is '{t.lr_schedule}')")
    if t.keep_every is not None and t.keep_every % t.save_every:
        raise ConfigError(f"{where}: train.keep_every={t.keep_every} is not a multiple of train.save_every "
                          f"({t.save_every}): no checkpoint would be written at most of its steps")
    if t.compile == "model" and (cfg.model.kind != "unet" or cfg.model.pack_chunks is None or
                                 cfg.deepspeed.get("zero_optimization", {}).get("stage", 0) == 3):
        raise ConfigError(f"{where}: train.compile 'model' compiles the byte model's whole forward as one graph: it "
                          f"needs model.kind 'unet', model.pack_chunks (the row layout reads the chunk counts on "
                          f"the host) and ZeRO stage 0-2 (ZeRO-3's parameter hooks split the graph); use "
                          f"train.compile true for the blocks alone")
    capacity = cfg.model.chunk_capacity
    if capacity is not None and cfg.model.kind == "unet" and capacity < cfg.boundary.target_rate:
        raise ConfigError(f"{where}: model.chunk_capacity={capacity:g} is below boundary.target_rate "
                          f"({cfg.boundary.target_rate:g}): rows at the target rate would lose starts; set it above "
                          f"the rate the boundaries may reach (e.g. twice the target)")
    try:
        check_config(cfg, world_size)  # the strategy's own
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
