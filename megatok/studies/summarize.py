"""Print a run's result table: what it learned, next to what simple baselines get on the same text.

    megatok-summarize --run runs/tiny [--data data/shards] [--eval RUN/eval.json]

Reference rows: the byte-unigram entropy of the training text (what a model that knows only byte
frequencies gets), and gzip -9 / bzip2 -9 on the validation text (classic compressors, in bits per
byte). Writes RUN/summary.json too.
"""

from __future__ import annotations

import bz2
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from megatok.data.stream import from_run_config, iter_shard_documents, resolve_shards
from megatok.metrics import finite_or_none, read_metrics
from megatok.run.checkpoints import latest_tag
from megatok.run.reader import run_config
from megatok.studies import StudyError


def unigram_entropy(texts) -> float:
    counts = np.zeros(256, dtype=np.int64)
    for t in texts:
        counts += np.bincount(np.frombuffer(t, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def compressor_bpb(text: bytes) -> dict[str, float]:
    n = len(text)
    return {"gzip -9": 8 * len(gzip.compress(text, 9)) / n, "bzip2 -9": 8 * len(bz2.compress(text, 9)) / n}


def summarize(run: str | Path, data=None, eval_file: str | None = None) -> dict:
    """The run's result table, printed, and written to RUN/summary.json (returned): its training and
    validation figures, megatok-evaluate's held-out figures (``eval_file``, default RUN/eval.json if there),
    and the references, on ``data`` (default the run's data.shards). StudyError, ConfigError or DataError
    (one line) on bad input."""
    run = Path(run)
    if not (run / "config.json").is_file() or not (run / "metrics.jsonl").is_file():
        raise StudyError(f"{run}: not a run directory (needs config.json and metrics.jsonl)")
    cfg = run_config(run)
    data = data or from_run_config(cfg.data.shards)
    rows = read_metrics(run)
    train = [r for r in rows if r.get("split") == "train"]
    val = [r for r in rows if r.get("split") == "val"]
    if not train:
        raise StudyError(f"{run / 'metrics.jsonl'}: no training rows yet")
    ev, latest = _evaluation(run, eval_file)
    entropy = unigram_entropy(d.text for d in iter_shard_documents(resolve_shards(data, "train")))
    val_text = b"\n".join(d.text for d in iter_shard_documents(resolve_shards(data, "val")))
    comp = compressor_bpb(val_text)
    tokens = cfg.model.kind == "bpe"  # the BPE token model: no boundaries
    unit = "token" if tokens else "chunk"
    last = train[-1]
    summary = {
        "run": str(run), "strategy": "bpe token model" if tokens else cfg.boundary.strategy,
        "steps": last["step"], "train_bytes": last["bytes_seen"], "final_train_bpb": last["bpb"],
        "final_val_bpb": val[-1]["val_bpb"] if val else None,
        f"val_bytes_per_{unit}": val[-1][f"val_bytes_per_{unit}"] if val else None,
        "val_boundary_rate": val[-1]["val_boundary_rate"] if val and not tokens else None,
        "target_rate": None if tokens else cfg.boundary.target_rate, "byte_unigram_entropy": entropy, **comp,
        "evaluate": {k: ev.get(k) for k in ("checkpoint", "boundary_rule", "bpb", f"bytes_per_{unit}",
                                            "boundary_rate", "whitespace_boundary_fraction", "bytes")} if ev else None,
    }
    (run / "summary.json").write_text(json.dumps(finite_or_none(summary), indent=2, allow_nan=False) + "\n")
    _print_table(run, summary, comp, val, last, ev, latest, unit)
    return summary


def _evaluation(run: Path, eval_file: str | None) -> tuple[dict | None, str | None]:
    """(megatok-evaluate's output for the run, or None; the run's latest checkpoint), with a warning when
    the evaluation scored another checkpoint."""
    eval_path = Path(eval_file) if eval_file else run / "eval.json"
    if eval_file and not eval_path.is_file():
        raise StudyError(f"--eval {eval_path}: no such file")
    try:
        ev = json.loads(eval_path.read_text()) if eval_path.is_file() else None
    except json.JSONDecodeError as e:  # e.g. an empty file left by `evaluate.py > RUN/eval.json` that failed
        raise StudyError(f"{eval_path}: not megatok-evaluate output ({e.msg} at line {e.lineno}); rerun "
                         f"megatok-evaluate, or remove the file") from None
    if ev is not None and not (isinstance(ev, dict) and "bpb" in ev):
        raise StudyError(f"{eval_path}: not megatok-evaluate output (no \"bpb\")")
    latest = latest_tag(run)
    if ev and ev.get("checkpoint") != latest:  # e.g. the run trained on after eval.json was written
        print(f"warning: {eval_path} scored checkpoint {ev.get('checkpoint')}, the run's latest is {latest}: its "
              f"held-out row is that checkpoint's (rerun megatok-evaluate for the latest)", file=sys.stderr)
    return ev, latest


def _print_table(run: Path, summary: dict, comp: dict, val: list[dict], last: dict, ev: dict | None,
                 latest: str | None, unit: str) -> None:
    tokens, target, entropy = unit == "token", summary["target_rate"], summary["byte_unigram_entropy"]

    def line(name, value, note=""):
        print(f"| {name:<44} | {value:>12} | {note}")

    def fmt(v):  # None: a ratio with nothing to count (evaluate.py writes NaN as null)
        return "n/a" if v is None else f"{v:.4f}"

    print(f"\n## {run}  (strategy {summary['strategy']}, {summary['steps']} steps, "
          f"{summary['train_bytes'] / 1e6:.1f} MB of training text)\n")
    print(f"| {'figure':<44} | {'value':>12} | note\n|{'-' * 46}|{'-' * 14}|-----")
    if val:
        line("val bits per byte (training-time validation)", fmt(summary["final_val_bpb"]),
             val[-1].get("boundary_rule", "BPE tokens"))
    if ev:
        line("held-out bits per byte (megatok-evaluate)", fmt(ev["bpb"]),
             f"{ev.get('boundary_rule') or 'BPE tokens'}, {ev['bytes']:,} bytes"
             + (f", {ev.get('checkpoint')} (not the latest, {latest})" if ev.get("checkpoint") != latest else ""))
    line("byte-unigram entropy of the training text", fmt(entropy), "a model must beat this")
    for k, v in comp.items():
        line(f"{k} on the validation text", fmt(v), "bits per byte")
    if not tokens:
        rate = ev["boundary_rate"] if ev else summary["val_boundary_rate"] or last["boundary_rate"]
        ok = "within 0.05 of target" if abs(rate - target) <= 0.05 else "NOT within 0.05 of target"
        line("boundary rate", fmt(rate), f"target {target}: {ok}")
    per_unit = (ev or {}).get(f"bytes_per_{unit}", summary[f"val_bytes_per_{unit}"] or last[f"bytes_per_{unit}"])
    line(f"bytes per {unit}", f"{per_unit:.2f}", "")
    if ev:
        if not tokens:
            line("whitespace positions with a boundary", fmt(ev["whitespace_boundary_fraction"]), "")
        for lang, r in sorted(ev.get("by_domain", {}).items()):
            line(f"  bpb, domain {lang}", fmt(r["bpb"]),
                 f"{r['bytes']:,} bytes, {r[f'bytes_per_{unit}']:.2f} bytes/{unit}")
    best = (ev or {}).get("bpb", summary["final_val_bpb"] or last["bpb"])
    verdict = "learned" if best < entropy else "NOT below unigram entropy"
    print(f"\nverdict: {verdict}; figures in {run / 'summary.json'}")
