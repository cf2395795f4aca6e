"""A run directory read after (or while) training, by the tools: no engine, no process group.

``run_config`` is the config a run wrote, ``load_model`` its model with a checkpoint's weights merged
from any ZeRO stage and world size (``consolidated_state_dict``). A run records its tokenizer paths as
it was given them, often relative to the directory it was started from; they are looked up from
there (``launch_dir``), so a run can be read from any directory. Exports (megatok.run.export) read their
config the same way (``written_config``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from megatok.config import Config, ConfigError, load_config
from megatok.dsconfig import zero_stage
from megatok.model import build_model
from megatok.run.checkpoints import (META, CheckpointError, checkpoint_dir, damage, latest_tag, published_tags,
                                     restorable)
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
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json here; is {run_dir} a megatok run directory?")
    recorded = _read(path).get("train", {}).get("run_dir", "")
    # the start directory's files first: a file of the same relative name here may be another tokenizer
    return written_config(path, launch_dir(run_dir, recorded), base_first=True)


def consolidated_state_dict(run_dir: str | Path, tag: str, cfg: Config) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint, merging ZeRO partitions; no engine or process group needed.
    Refuses a tokenizer the config names that is not the one the checkpoint was trained with."""
    ckpt = checkpoint_dir(run_dir) / tag
    if not ckpt.is_dir():
        aside = restorable(run_dir, tag)
        if aside != ckpt:  # a killed re-save moved it aside; the trainer puts it back when it starts
            raise CheckpointError(f"{ckpt}: moved aside to {aside.name} by a save that was killed; the next "
                                  f"training start puts it back (or rename it to {tag})")
        raise FileNotFoundError(f"{ckpt}: checkpoint not found")
    if problem := damage(run_dir, tag):
        raise CheckpointError(f"{ckpt}: cannot be read: {problem}")
    check_model_files(json.loads((ckpt / META).read_text()), ckpt, cfg)  # before the merge, which can be slow
    if zero_stage(cfg) >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints progress; stdout stays the tools' own
            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    else:
        state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
    return {k: v.float() for k, v in state.items()}


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


def load_model(run_dir: str | Path, tag: str | None = None, device: str | torch.device = "cpu"):
    """The model of a run's checkpoint, in fp32, without DeepSpeed's engine or a process group.

    Returns (model, config, tag). Works for every ZeRO stage (the ZeRO-2/3 partitions are merged).
    """
    cfg = run_config(run_dir)
    tag = checkpoint_to_read(run_dir, tag)
    state = consolidated_state_dict(run_dir, tag, cfg)  # first: it checks the tokenizer the model would read
    model = build_model(cfg)
    model.load_state_dict(state)
    return model.to(device).eval(), cfg, tag
