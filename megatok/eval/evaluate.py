"""A run's checkpoint scored on text files: what ``megatok-evaluate`` prints, as a dict (the replication
study scores its runs with it too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from megatok.data.documents import DataError, list_input_files
from megatok.data.inputs import read_documents
from megatok.eval.bpb import boundary_rule, evaluate_documents
from megatok.metrics import finite_or_none


def evaluate_run(run: str, data: list[str], *, checkpoint: str | None = None, boundary: str = "sample",
                 seed: int = 0, seq_len: int | None = None, batch_size: int = 8, device: str = "cpu",
                 max_bytes: float | None = None, progress: bool = True) -> dict:
    """The run's checkpoint (default: latest), or an export's model, scored on ``data`` (files, directories or
    a shard directory's validation split). Raises DataError, FileNotFoundError or ConfigError on bad input,
    DataError when there are no documents."""
    from megatok.data.encoding import encoding_for
    from megatok.run.export import load_model_or_export

    list_input_files([p for p in data if not Path(p, "manifest.json").is_file()])  # fail before loading
    model, cfg, tag = load_model_or_export(run, checkpoint, device)
    docs = read_documents(data, "val")
    if max_bytes:
        docs = _limit(docs, int(max_bytes))
    total = _known_bytes(data, "val")
    if max_bytes:
        total = int(max_bytes) if total is None else min(total, int(max_bytes))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="evaluate", file=sys.stderr,
               disable=None if progress else True)
    result = evaluate_documents(model, docs, seq_len=seq_len or cfg.data.seq_len, batch_size=batch_size,
                                mode=boundary, seed=seed, device=device, progress=bar, encoding=encoding_for(cfg))
    bar.close()
    if not result["documents"]:
        raise DataError(f"no documents in {' '.join(map(str, data))}")
    return finite_or_none({"run": str(run), "checkpoint": tag, "kind": cfg.model.kind,
                           "strategy": cfg.boundary.strategy if cfg.model.kind == "unet" else None,
                           "boundary_rule": boundary_rule(boundary, seed) if cfg.model.kind == "unet" else None,
                           **result})


def _known_bytes(data: list[str], split: str) -> int | None:
    """The bytes of text ``data`` holds, where that is known before reading it: a shard set's manifest
    records its splits' bytes; plain files are counted as their size (their text, or more: a JSON line's
    keys). None for a compressed file (its size says little) or a manifest without the figure."""
    total = 0
    for p in map(Path, data):
        if (p / "manifest.json").is_file():
            try:
                total += int(json.loads((p / "manifest.json").read_text())["bytes"][split])
            except (OSError, ValueError, KeyError, TypeError):
                return None
            continue
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
        if any(f.suffix in (".gz", ".zst", ".parquet", ".arrow") for f in files):
            return None
        total += sum(f.stat().st_size for f in files)
    return total


def _limit(docs, max_bytes):
    seen = 0
    for d in docs:
        if seen >= max_bytes:
            return
        seen += len(d.text)
        yield d
