"""Checkpoints: DeepSpeed's own format under RUN_DIR/checkpoints/<tag>, plus a loader for evaluation.

The engine saves model, optimizer (ZeRO partitions), LR schedule; megatok adds a small
``client_state`` (step, batches consumed per rank, world size) so a new process continues the run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatok.config import Config, load_config, zero_stage

CHECKPOINTS = "checkpoints"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(run_dir: str | Path) -> str | None:
    latest = checkpoint_dir(run_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def save(engine, run_dir: str | Path, step: int, client_state: dict) -> str:
    """Collective: every rank calls it. DeepSpeed updates ``latest`` after the files are written."""
    tag = tag_for(step)
    engine.save_checkpoint(str(checkpoint_dir(run_dir)), tag=tag, client_state=client_state)
    return tag


def load(engine, run_dir: str | Path, tag: str | None = None) -> dict | None:
    """Collective. Returns the client state, or None when the run directory has no checkpoint."""
    tag = tag or latest_tag(run_dir)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    if path is None:
        raise RuntimeError(f"{checkpoint_dir(run_dir) / tag}: DeepSpeed could not load this checkpoint")
    return client_state


def run_config(run_dir: str | Path) -> Config:
    """The resolved config a run wrote, loaded for the world size it was written with."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json here; is {run_dir} a megatok run directory?")
    import json

    t = json.loads(path.read_text())["train"]
    world = (t["global_batch_size"] // (t["micro_batch_size"] * t["grad_accum"])) if t.get("global_batch_size") else 1
    return load_config(path, world_size=world)


def load_model(run_dir: str | Path, tag: str | None = None, device: str | torch.device = "cpu"):
    """The model of a run's checkpoint, in fp32, without DeepSpeed's engine or a process group.

    Returns (model, config, tag). Works for every ZeRO stage (the ZeRO-2/3 partitions are merged).
    """
    from megatok.model.unet import ByteUNet

    cfg = run_config(run_dir)
    tag = tag or latest_tag(run_dir)
    if tag is None:
        raise FileNotFoundError(f"{checkpoint_dir(run_dir)}: no checkpoint (no 'latest' file)")
    ckpt = checkpoint_dir(run_dir) / tag
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt}: checkpoint not found")
    if zero_stage(cfg) >= 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(run_dir)), tag=tag)
    else:
        state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
    model = ByteUNet(cfg.model, cfg.boundary)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device).eval(), cfg, tag
