"""Export a trained model out of DeepSpeed's checkpoint format, and load it back.

An export directory holds ``model.safetensors`` (full weights, fp32 or bf16, merged from any ZeRO
stage), ``config.json`` (the run's resolved config), ``export.json`` (where it came from) and the
tokenizer the model needs, if any (``tokenizer.model``, ``boundary.model``), so it can be moved and
loaded anywhere. Loading reads only safetensors, JSON and sentencepiece's model: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatok.config import Config
from megatok.model import build_model
from megatok.run.checkpoints import read_meta
from megatok.run.reader import MODEL_FILES, checkpoint_to_read, consolidated_state_dict, run_config, written_config

WEIGHTS, CONFIG, INFO = "model.safetensors", "config.json", "export.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export(run_dir: str | Path, out_dir: str | Path, *, dtype: str = "fp32", tag: str | None = None) -> Path:
    """Write the export of ``run_dir``'s checkpoint ``tag`` (default: latest); returns out_dir."""
    run_dir, out_dir = Path(run_dir), Path(out_dir).absolute()  # "." has no name to put NAME.tmp next to
    check_out_dir(out_dir)
    cfg = run_config(run_dir)
    tag = checkpoint_to_read(run_dir, tag)
    state = consolidated_state_dict(run_dir, tag, cfg)
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items()}, str(tmp / WEIGHTS),
              metadata={"format": "pt", "megatok_tag": tag})
    raw = cfg.to_dict()
    for (section, key), name in zip(MODEL_FILES, ("tokenizer.model", "boundary.model")):
        if raw[section].get(key):  # the run's tokenizer, copied in: the export does not depend on its path
            src = Path(raw[section][key])
            shutil.copyfile(src / "tokenizer.model" if src.is_dir() else src, tmp / name)
            raw[section][key] = name
    (tmp / CONFIG).write_text(json.dumps(raw, indent=2) + "\n")
    meta = read_meta(run_dir, tag)
    (tmp / INFO).write_text(json.dumps({"run_dir": str(run_dir), "tag": tag, "step": meta["step"], "dtype": dtype,
                                        "parameters": sum(v.numel() for v in state.values())}, indent=2) + "\n")
    old = out_dir.with_name(out_dir.name + f".old-{os.getpid()}")
    if out_dir.is_dir() and not any(out_dir.iterdir()):  # an empty directory (--out .) is filled, not replaced
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
        return out_dir
    if out_dir.exists():  # an earlier export: moved aside first (killed in between, NAME.old-PID holds it)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def check_out_dir(out_dir: str | Path) -> None:
    """An export replaces only an earlier export: never a file, a run or someone's notes."""
    out_dir = Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not all((out_dir / f).is_file() for f in (INFO, WEIGHTS, CONFIG)):
        raise FileExistsError(f"{out_dir}: exists and is not a megatok export (no {INFO}, {WEIGHTS} and {CONFIG}); "
                              f"choose another --out or remove it")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir}: exists and is not a directory; choose another --out")


def load_exported(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """(model, config) from an export directory, ready for evaluation (eval mode)."""
    path = Path(path)
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path / WEIGHTS}: not a megatok export")
    cfg: Config = written_config(path / CONFIG, path.resolve(), base_first=True)  # its own tokenizer first
    model = build_model(cfg)
    state = load_file(str(path / WEIGHTS), device="cpu")
    model.load_state_dict({k: v.to(dtype or torch.float32) for k, v in state.items()})
    return model.to(device=device, dtype=dtype or torch.float32).eval(), cfg
