"""The GPU check's generation section (megatok.perf.gpu_check): megatok.generate.generate_batch's step
modes against each other on one device.

Two small untrained models in fp32: the byte model of configs/tiny.json (the check's --set applied; its
boundaries sampled) and a BPE token model of the same width whose main network has the byte model's
layers, encoder and decoder included, on a 512-piece tokenizer trained here on the Python standard
library's sources, with half the byte model's window in tokens. Each continues prompts of different
lengths cut from those sources (one longer than the byte model's window, one that reaches it while
generating) at batch 1 and 8, row i with seed i, for --gen-bytes bytes a row (a sampled separator may end
a row sooner), in each step mode:

- ``cached``: the default step (the rows' lengths read on the host; a row that ends leaves the batch);
- ``static``: fixed shapes and no host read in the step (``generate_batch(static=True)``);
- ``cuda_graph``: the static step captured once per call as a CUDA graph and replayed
  (``cuda_graph=True``; on a GPU only: on a CPU it is an error by design).

Each mode after ``cached`` is compared with it row by row: rows whose text (and, for the byte model,
boundaries) is identical; the share of identical bytes (each row's common prefix: a draw that float
rounding flips sends the row its own way from there); the largest log-probability difference over the
ids the two share. ``equal``: every row identical and that difference under 1e-3. Each mode's bytes/s is
timed on its second call (the first warms up; a CUDA graph is captured at every call, and the time
includes the capture).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megatok.config import load_config
from megatok.generate import Generation, generate_batch
from megatok.model import build_model
from megatok.perf.timing import sync, text_documents

#: The batch sizes generated at.
BATCHES = (1, 8)
#: The largest log-probability difference (over the ids two modes share) that still counts as equal.
LOGPROB_TOLERANCE = 1e-3


def modes(device: torch.device) -> tuple[str, ...]:
    return ("cached", "static", "cuda_graph") if device.type == "cuda" else ("cached", "static")


def generation_check(device: torch.device, config: str, overrides: list[str], *, max_bytes: int,
                     batches=BATCHES, deadline: float | None = None, rows: list | None = None,
                     save=lambda done: None) -> list[dict]:
    """The section's rows, one per (model, batch), appended to ``rows`` (returned) as each is measured,
    ``save(what)`` called after each; a row that would start past the monotonic ``deadline`` is recorded
    as skipped."""
    rows = [] if rows is None else rows
    tmp = Path(tempfile.mkdtemp(prefix="megatok-gpu-generation-"))
    try:
        models = _models(device, config, overrides, tmp)
        prompts = _prompts(models[0][1].data.seq_len, max(batches))
        for kind, cfg, model, encoding in models:
            for batch in batches:
                if deadline is not None and time.monotonic() > deadline:
                    rows.append({"model": kind, "batch": batch, "error": "skipped: --budget-s spent"})
                else:
                    rows.append(compare_modes(model, cfg, encoding, prompts[:batch], device, max_bytes, kind))
                save(f"generation {kind} batch {batch} done")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _models(device: torch.device, config: str, overrides: list[str], tmp: Path) -> list[tuple]:
    """[(kind, config, model, encoding)] of the byte model and the BPE token model, built on ``device``."""
    from megatok import bpe
    from megatok.data.encoding import encoding_for

    byte_cfg = load_config(config, list(overrides), world_size=1)
    m = byte_cfg.model
    docs = text_documents(200_000)
    tok = bpe.train_bpe(docs, tmp / "tok", 512)
    per_token = bpe.bytes_per_token(bpe.load_tokenizer(tok["model"]), docs)["bytes_per_token"]
    bpe_cfg = load_config(config, [*overrides, "model.kind=bpe", f"model.tokenizer={tok['model']}",
                                   f"model.vocab_size={tok['vocab_size']}", f"model.bytes_per_token={per_token:.3f}",
                                   "model.n_encoder_layers=0", "model.n_decoder_layers=0",
                                   f"model.n_main_layers={m.n_encoder_layers + m.n_main_layers + m.n_decoder_layers}",
                                   f"data.seq_len={byte_cfg.data.seq_len // 2}"], world_size=1)
    out = []
    for kind, cfg in (("byte", byte_cfg), ("bpe", bpe_cfg)):
        torch.manual_seed(0)
        with torch.device(device):
            model = build_model(cfg).eval()
        out.append((kind, cfg, model, encoding_for(cfg)))
    return out


def _prompts(seq_len: int, n: int) -> list[bytes]:
    """``n`` prompts of different lengths for a byte window of ``seq_len``: the third longer than the window,
    the seventh 8 bytes short of it (its row fills the window while generating)."""
    text = b"".join(text_documents(20 * seq_len))
    lengths = [seq_len // 5, 24, seq_len + 40, 57, seq_len // 2, 16, seq_len - 8, 40]
    return [text[1000 * i:1000 * i + lengths[i % len(lengths)]] for i in range(n)]


def compare_modes(model, cfg, encoding, prompts: list[bytes], device: torch.device, max_bytes: int,
                  kind: str) -> dict:
    """One row: every mode's bytes, seconds and bytes/s on ``prompts``, and each mode's agreement with
    ``cached``; a mode that fails records its error and the others go on."""
    byte_model = kind == "byte"
    boundary = "threshold" if byte_model and model.boundary.reads_earlier_decisions else "sample"
    row = {"model": kind, "batch": len(prompts), "params": sum(p.numel() for p in model.parameters()),
           "seq_len": cfg.data.seq_len, "max_bytes": max_bytes, "prompt_bytes": [len(p) for p in prompts]}
    reference = None
    for mode in modes(device):
        run = functools.partial(generate_batch, model, prompts, seq_len=cfg.data.seq_len, max_bytes=max_bytes,
                                seeds=list(range(len(prompts))), boundary_mode=boundary, encoding=encoding,
                                static=mode != "cached", cuda_graph=mode == "cuda_graph")
        try:
            run()  # warm-up
            sync(device)
            t = time.perf_counter()
            gens = run()
            sync(device)
            seconds = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - one mode failing must not cost the others
            traceback.print_exc()
            row[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        done = sum(len(g.text) for g in gens)
        row[mode] = {"bytes": done, "s": round(seconds, 4), "bytes_per_s": round(done / seconds)}
        if reference is None:
            reference = gens
        else:
            row[mode].update(agreement(reference, gens, byte_model))
    return row


def agreement(ref: list[Generation], got: list[Generation], byte_model: bool) -> dict:
    """How far ``got`` agrees with ``ref``, row by row (see the module's docstring)."""
    same = [a.text == b.text and a.stopped == b.stopped and (not byte_model or (a.starts, a.prompt_starts)
                                                              == (b.starts, b.prompt_starts))
            for a, b in zip(ref, got)]
    common = [len(os.path.commonprefix([a.text, b.text])) for a, b in zip(ref, got)]
    longest = sum(max(len(a.text), len(b.text)) for a, b in zip(ref, got))
    shared_ids = [len(os.path.commonprefix([a.ids, b.ids])) for a, b in zip(ref, got)]
    diff = max((abs(x - y) for a, b, n in zip(ref, got, shared_ids) for x, y in zip(a.logprobs[:n], b.logprobs[:n])),
               default=0.0)
    return {"identical_rows": sum(same), "identical_bytes": round(sum(common) / longest, 4) if longest else 1.0,
            "logprob_max_diff": float(f"{diff:.3g}"), "equal": all(same) and diff <= LOGPROB_TOLERANCE}


def show_generation(report: dict) -> list[str]:
    lines = ["generation (generate_batch on untrained models: each mode against the cached step)",
             "| model | batch | mode | bytes | s | bytes/s | identical rows | identical bytes | max logprob diff | "
             "equal |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in report.get("generation", []):
        if "error" in r:
            lines.append(f"| {r.get('model', '-')} | {r.get('batch', '-')} | error: {r['error']} |")
            continue
        for mode in (m for m in ("cached", "static", "cuda_graph") if m in r):
            m = r[mode]
            if "error" in m:
                lines.append(f"| {r['model']} | {r['batch']} | {mode} | error: {m['error']} |")
                continue
            same = f"{m['identical_rows']}/{r['batch']}" if "identical_rows" in m else "-"
            lines.append(f"| {r['model']} | {r['batch']} | {mode} | {m['bytes']} | {m['s']} | {m['bytes_per_s']:,} | "
                         f"{same} | {m.get('identical_bytes', '-')} | {m.get('logprob_max_diff', '-')} | "
                         f"{m.get('equal', '-')} |")
    if report.get("generation") and report["environment"]["device"] == "cpu":
        lines.append("  (cuda_graph: on a GPU only)")
    return lines
