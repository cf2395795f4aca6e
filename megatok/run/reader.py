"""A run directory read after (or while) training, by the tools: no engine, no process group.

``run_config`` is the config a run wrote, ``load_model`` its model with a checkpoint's weights merged
from any ZeRO stage and world size one tensor at a time (``checkpoint_weights``, megatok.run.merge). A run records its tokenizer paths as
it was given them, often relative to the directory it was started from; they are looked up from
there (``launch_dir``), so a run can be read from any directory. Exports (megatok.run.export) read their
config the same way (``written_config``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from megatok.config import Config, ConfigError, load_config
from megatok.model import build_model
from megatok.run.checkpoints import (META, CheckpointError, checkpoint_dir, damage, latest_tag, parse_meta,
                                     published_tags, restorable)
from megatok.run.merge import LazyTensor, checkpoint_tensors
from megatok.run.same_model import check_model_files

# Files a model needs to be built (a tokenizer).
MODEL_FILES = (("model", "tokenizer"), ("boundary", "model_path"))


def launch_dir(run_dir: str | Path, recorded: str) -> Path | None:
    """The directory a run was started from, when it was given a relative ``train.run_dir`` (``recorded``):
    the run directory's absolute path less that. None if they do not line up (the run was renamed)."""
    rel, here = Path(recorded), Path(os.path.abspath(run_dir))  # not resolve(): runs/ is often a symlink
    n = len(rel.parts)
    if rel.is_absolute() or ".." in rel.parts or n == 0 or here.parts[-n:] != rel.parts:
        return None
    return Path(*here.parts[:-n])


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    return raw


def written_config(path: Path, base: Path | None, *, base_first: bool = False) -> Config:
    """A config.json that a run or an export wrote, loaded for the world size it was written with. Its
    relative MODEL_FILES paths are looked up in ``base`` where they exist there: those that do not exist
    from the working directory, or all of them with ``base_first``."""
    raw = _read(path)
    t = raw.get("train", {})
    world = (t["global_batch_size"] // (t["micro_batch_size"] * t["grad_accum"])) if t.get("global_batch_size") else 1
    found = []
    for section, key in MODEL_FILES if base is not None else ():
        value = raw.get(section, {}).get(key)
        if value and not Path(value).is_absolute() and (base_first or not Path(value).exists()) \
                and (base / value).exists():
            found.append(f"{section}.{key}={base / value}")
    return load_config(path, found, world_size=world)


def run_config(run_dir: str | Path) -> Config:
    """The resolved config a run wrote. A relative tokenizer path that does not exist from here is
    looked up from the directory the run was started from."""
    path = Path(run_dir) / "config.json"
    if (Path(run_dir) / "export.json").is_file() and not (Path(run_dir) / "checkpoints").is_dir():
        raise FileNotFoundError(f"{run_dir}: an export (megatok-export), not a run directory: this command reads runs; "
                                f"megatok.load, megatok-evaluate, megatok-generate and megatok-lm-eval read exports")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json here; is {run_dir} a megatok run directory?")
    recorded = _read(path).get("train", {}).get("run_dir", "")
    # the start directory's files first: a file of the same relative name here may be another tokenizer
    return written_config(path, launch_dir(run_dir, recorded), base_first=True)


def checkpoint_weights(run_dir: str | Path, tag: str, cfg: Config) -> dict[str, LazyTensor]:
    """A checkpoint's full weights, merged from any ZeRO stage and world size, one tensor at a time
    (megatok.run.merge: nothing is read until a tensor is loaded); no engine or process group needed.
    Refuses a damaged checkpoint, and a tokenizer the config names that is not the one the checkpoint
    was trained with."""
    ckpt = checkpoint_dir(run_dir) / tag
    if not ckpt.is_dir():
        aside = restorable(run_dir, tag)
        if aside != ckpt:  # a killed re-save moved it aside; the trainer puts it back when it starts
            raise CheckpointError(f"{ckpt}: moved aside to {aside.name} by a save that was killed; the next "
                                  f"training start puts it back (or rename it to {tag})")
        raise FileNotFoundError(f"{ckpt}: checkpoint not found")
    if problem := damage(run_dir, tag):
        raise CheckpointError(f"{ckpt}: cannot be read: {problem}")
    check_model_files(parse_meta((ckpt / META).read_text()), ckpt, cfg)  # before the merge, which can be slow
    return checkpoint_tensors(ckpt)


def consolidated_state_dict(run_dir: str | Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint, all in memory (see checkpoint_weights for one at a time)."""
    return {k: v.load().float() for k, v in checkpoint_weights(run_dir, tag, cfg).items()}


def checkpoint_to_read(run_dir: str | Path, tag: str | None) -> str:
    """``tag``, or the run's latest checkpoint: a FileNotFoundError naming the run's checkpoints when
    there is none to read."""
    tag = tag or latest_tag(run_dir)
    if tag:
        return tag
    tags = published_tags(run_dir)
    why = "its 'latest' file is empty" if tag == "" else "no 'latest' file"
    raise FileNotFoundError(f"{checkpoint_dir(run_dir)}: {why}; "
                            + (f"its checkpoints: {', '.join(tags)} (name one)" if tags else "no checkpoint"))


def load_model(run_dir: str | Path, tag: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None):
    """The model of a run's checkpoint (``dtype``, default fp32), without DeepSpeed's engine or a process
    group, in eval mode. Returns (model, config, tag). Works for every ZeRO stage (the partitions are
    merged). Host memory: one copy of the weights in ``dtype`` (built on ``device``), plus one tensor."""
    cfg = run_config(run_dir)
    tag = checkpoint_to_read(run_dir, tag)
    weights = checkpoint_weights(run_dir, tag, cfg)  # first: it checks the tokenizer the model would read
    model = materialise(cfg, weights, device, dtype, where=str(checkpoint_dir(run_dir) / tag))
    return model, cfg, tag


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters registered in this block live on the meta device (no memory, and their initialisation
    does nothing); buffers are built as usual (a token model's byte lengths come from its tokenizer)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def materialise(cfg: Config, weights: dict[str, LazyTensor], device, dtype: torch.dtype | None, where: str):
    """The config's model with ``weights`` (name -> LazyTensor) loaded one at a time: built with its
    parameters on the meta device, each then set from its tensor converted to ``dtype`` (default fp32;
    floating tensors only) on ``device``. Missing, unexpected or misshapen weights are a ValueError
    naming them."""
    dtype = dtype or torch.float32
    with parameters_on_meta():
        model = build_model(cfg)
    slots = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    seen, problems = set(), []
    for key, lazy in weights.items():
        if key not in slots:
            problems.append(f"unexpected {key}")
            continue
        if tuple(lazy.shape) != tuple(slots[key].shape):
            problems.append(f"{key} has shape {list(lazy.shape)}, the model's is {list(slots[key].shape)}")
            continue
        value = lazy.load(dtype).to(device)  # converted as it is read: never a float32 copy of a bf16 model
        owner, _, attr = key.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=slots[key].requires_grad)
        else:
            module._buffers[attr] = value
        seen.add(key)
        del value
    missing = [n for n, p in model.named_parameters() if n not in seen]
    if missing or problems:
        raise ValueError(f"{where}: not the weights of the model its config builds: "
                         + "; ".join(problems + [f"missing {n}" for n in missing][:8]))
    return model.to(device=device, dtype=dtype).eval()
