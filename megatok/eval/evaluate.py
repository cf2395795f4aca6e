"""A run's checkpoint scored on text files: what ``megatok-evaluate`` prints, as a dict (the replication
study scores its runs with it too)."""

from __future__ import annotations

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
    bar = tqdm(unit="B", unit_scale=True, desc="evaluate", file=sys.stderr, disable=None if progress else True)
    result = evaluate_documents(model, docs, seq_len=seq_len or cfg.data.seq_len, batch_size=batch_size,
                                mode=boundary, seed=seed, device=device, progress=bar, encoding=encoding_for(cfg))
    bar.close()
    if not result["documents"]:
        raise DataError(f"no documents in {' '.join(map(str, data))}")
    return finite_or_none({"run": str(run), "checkpoint": tag, "kind": cfg.model.kind,
                           "strategy": cfg.boundary.strategy if cfg.model.kind == "unet" else None,
                           "boundary_rule": boundary_rule(boundary, seed) if cfg.model.kind == "unet" else None,
                           **result})


def _limit(docs, max_bytes):
    seen = 0
    for d in docs:
        if seen >= max_bytes:
            return
        seen += len(d.text)
        yield d
