"""Is a checkpoint the model a config builds? Every checkpoint records its parameters' shapes and the
digests of the files the model reads besides its weights (a tokenizer); a resume, an export or a tool
that loads a run checks them against the config, so a changed model or a tokenizer replaced at the
same path is named, not loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatok.config import Config
from megatok.flops import build_meta_model
from megatok.run.checkpoints import META, CheckpointError, checkpoint_dir, restorable


def model_shapes(cfg: Config) -> dict[str, list[int]]:
    """Every parameter's full shape, from the model built on the meta device (no memory, any size)."""
    return {name: list(p.shape) for name, p in build_meta_model(cfg).named_parameters()}


def model_files(cfg: Config) -> dict[str, str]:
    """The files a model reads besides its weights, by config key (a token model's ``model.tokenizer``,
    the bpe strategy's ``boundary.model_path``): the first 16 hex digits of each one's sha256. Recorded
    in every checkpoint, so that a tokenizer replaced at the same path is noticed, not used."""
    paths = {"model.tokenizer": cfg.model.tokenizer if cfg.model.kind == "bpe" else None,
             "boundary.model_path": cfg.boundary.options.get("model_path") if cfg.model.kind != "bpe" else None}
    files = {key: Path(path) / "tokenizer.model" if Path(path).is_dir() else Path(path)  # as bpe.load_tokenizer
             for key, path in paths.items() if path}
    return {key: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for key, f in files.items() if f.is_file()}


def check_model_files(meta: dict, where: Path, cfg: Config) -> None:
    """A CheckpointError when a file the config points the model at is not the one the checkpoint
    (its metadata ``meta``, at ``where``) was trained with."""
    now = model_files(cfg)
    for key, digest in (meta.get("model_files") or {}).items():
        if now.get(key, digest) != digest:
            section, name = key.split(".")
            path = getattr(cfg.model, name) if section == "model" else cfg.boundary.options[name]
            raise CheckpointError(f"{where} was trained with another {key} than {path} holds now (sha256 "
                                  f"{digest}... then, {now[key]}... now: replaced since?); point {key} at the "
                                  f"file the run was trained with")


def check_same_model(run_dir: str | Path, tag: str, cfg: Config) -> None:
    """A CheckpointError, naming what changed, when ``cfg`` builds another model than checkpoint ``tag``
    holds (its ``param_shapes``), or points
    it at another tokenizer file (:func:`check_model_files`)."""
    meta = json.loads((restorable(run_dir, tag) / META).read_text())  # where resume_tag found it
    check_model_files(meta, checkpoint_dir(run_dir) / tag, cfg)
    saved, now = meta.get("param_shapes"), model_shapes(cfg)
    if saved is None:
        raise CheckpointError(f"{checkpoint_dir(run_dir) / tag}: its {META} records no param_shapes: not a checkpoint "
                              f"megatok's trainer wrote")
    if saved == now:
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
