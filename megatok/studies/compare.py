"""Compare runs side by side: a markdown table, validation curves, and a per-language table on parallel text.

    megatok-compare runs/policy runs/fixed runs/bpe --out docs/compare \\
        [--heldout data/heldout_udhr.jsonl] [--tokenizer runs/bpe4k/tokenizer.model]

Reads every RUN_DIR's config (megatok.run.reader.run_config) and metrics.jsonl (the byte model with any
boundary strategy, and the BPE token model: the same metric keys are read) and writes into --out:

- ``compare.md``: one row per run: model kind / boundary strategy, steps, bytes seen, training FLOPs
  (when known), final validation bpb, bytes per unit (``val_bytes_per_chunk``, or ``val_bytes_per_token``
  for a token model) and boundary rate (``val_boundary_rate``, else the mean of the training rows').
- ``val_bpb_vs_bytes.png``: validation bpb against training bytes seen, one line per run.
- ``val_bpb_vs_flops.png``: validation bpb against training FLOPs, from ``flops`` (cumulative training
  FLOPs) in its training rows, else from megatok.flops (FLOPs per byte at the realised rate x bytes; see
  megatok.flops.flops_at).
- for runs trained on a data mixture (validation rows with ``by_source``): a table of the final
  validation bpb per source and ``val_bpb_by_source.png`` (one panel per source, one line per run).
- a table of the configuration keys whose resolved values differ between the runs (``train.run_dir``
  left out), e.g. the seed, the boundary strategy and its options.
- ``compare.json``: every number above.

With ``--heldout FILE`` (documents with "lang", e.g. the parallel UDHR set of ``megatok-make-corpus
--heldout-out``), every run with a checkpoint is evaluated per language (through
megatok.eval.bpb.evaluate_documents, as megatok-evaluate), and with
``--tokenizer`` the BPE tokenizer's bytes per token are measured on the same text. ``compare.md`` then
has a per-language table (bytes per unit and bpb; units and bits for the same content) and the
disparity across languages: max / min over languages, and ``per_language.png`` (bars of both per
language and system). On parallel text the "units" disparity is how
many more chunks or tokens one language needs than another for the same content. A run without a
checkpoint is listed as skipped. Exit status 2 on bad input (a run whose config does not load among
them), one error line.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatok import flops
from megatok.bpe import bytes_per_token, disparity, load_tokenizer
from megatok.config import ConfigError
from megatok.data.documents import DataError, iter_documents, list_input_files
from megatok.data.encoding import encoding_for
from megatok.eval.bpb import boundary_rule, evaluate_documents
from megatok.metrics import finite_number as _num
from megatok.metrics import finite_or_none, read_metrics
from megatok.run.reader import load_model, run_config


def _fmt(v, spec: str) -> str:
    return format(v, spec) if _num(v) is not None else "-"


# ----------------------------------------------------------------------------- reading runs

def load_run(run_dir: str | Path) -> dict:
    """Summary of one run directory: identity, final figures and the validation curve."""
    run_dir = Path(run_dir)
    for name in ("config.json", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise DataError(f"{run_dir}: not a run directory (no {name})")
    try:
        rows = read_metrics(run_dir)
    except ValueError as e:
        raise DataError(f"{run_dir}: unreadable metrics.jsonl: {e}") from None
    cfg = run_config(run_dir)
    kind = cfg.model.kind
    strategy = cfg.boundary.strategy if kind == "unet" else None
    train = [r for r in rows if r.get("split") == "train" and _num(r.get("step")) is not None]
    val = [r for r in rows if r.get("split") == "val" and _num(r.get("val_bpb")) is not None]
    t = cfg.train  # the world size the run's global batch was written for
    world = t.global_batch_size // (t.micro_batch_size * t.grad_accum) if t.global_batch_size else 1
    bytes_for = flops.bytes_at(cfg, world, train)
    rates = [r["boundary_rate"] for r in train if _num(r.get("boundary_rate")) is not None]
    mean_rate = sum(rates) / len(rates) if rates else None
    flops_for = flops.flops_at(cfg, world, train)
    flops_source = "logged" if any(_num(r.get("flops")) for r in train) else "megatok.flops"

    curve = [{"step": r["step"], "bytes": bytes_for(r["step"]), "flops": flops_for(r["step"]),
              "val_bpb": r["val_bpb"],
              "by_source": {k: v.get("val_bpb") for k, v in (r.get("by_source") or {}).items()}} for r in val]
    last_val = val[-1] if val else {}
    unit = "token" if "val_bytes_per_token" in last_val or kind == "bpe" else "chunk"
    last_step = train[-1]["step"] if train else (val[-1]["step"] if val else 0)
    out = {
        "run": str(run_dir), "name": run_dir.name, "kind": kind, "strategy": strategy,
        "label": f"{kind}/{strategy}" if strategy else kind,
        "steps": last_step, "bytes_seen": bytes_for(last_step) if last_step else 0,
        "flops": flops_for(last_step) if last_step else None, "flops_source": flops_source,
        "val_bpb": last_val.get("val_bpb"), "val_step": last_val.get("step"),
        "unit": unit, "bytes_per_unit": last_val.get(f"val_bytes_per_{unit}"),
        "boundary_rate": last_val.get("val_boundary_rate", mean_rate),
        "boundary_rule": last_val.get("boundary_rule"), "curve": curve,
        "by_source": {k: v.get("val_bpb") for k, v in (last_val.get("by_source") or {}).items()},
        "has_checkpoint": (run_dir / "checkpoints" / "latest").is_file(),
        "config": _flat(cfg.to_dict()),
    }
    return out


def _flat(tree: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested config dict (lists and other leaves as they are)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(runs: list[dict]) -> dict[str, dict[str, object]]:
    """{dotted key: {run name: value}} for every config key (train.run_dir left out) whose resolved value
    differs between the runs, or that some run's config lacks (shown as "-")."""
    keys = sorted(set().union(*(r["config"] for r in runs)) - {"train.run_dir"})
    missing = object()
    out = {}
    for key in keys:
        values = [r["config"].get(key, missing) for r in runs]
        if any(json.dumps(v, sort_keys=True, default=str) != json.dumps(values[0], sort_keys=True, default=str)
               for v in values):
            out[key] = {r["name"]: ("-" if v is missing else v) for r, v in zip(runs, values)}
    return out


def differences_table(runs: list[dict], differences: dict) -> str:
    lines = ["| key | " + " | ".join(r["name"] for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for key, by_run in differences.items():
        lines.append(f"| `{key}` | " + " | ".join(f"`{json.dumps(by_run[r['name']], default=str)}`"
                                                  for r in runs) + " |")
    return "\n".join(lines)


def runs_table(runs: list[dict]) -> str:
    lines = ["| run | kind / strategy | steps | bytes seen | training FLOPs | final val bpb | bytes per unit | "
             "boundary rate |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['label']} | {r['steps']} | {_fmt(r['bytes_seen'], ',.0f')} | "
                     f"{_fmt(r['flops'], '.3g')} | {_fmt(r['val_bpb'], '.4f')} | "
                     f"{_fmt(r['bytes_per_unit'], '.2f')}" + (f" ({r['unit']})" if _num(r['bytes_per_unit']) else "")
                     + f" | {_fmt(r['boundary_rate'], '.3f')} |")
    return "\n".join(lines)


def sources_table(runs: list[dict], sources: list[str]) -> str:
    """Final validation bpb per data source (runs trained on a mixture report each source)."""
    lines = ["| run | " + " | ".join(sources) + " |", "|---|" + "---:|" * len(sources)]
    for r in runs:
        lines.append(f"| {r['name']} | " + " | ".join(_fmt(r["by_source"].get(s), ".4f") for s in sources) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots

def plot(runs: list[dict], x: str, path: Path, xlabel: str) -> bool:
    """val_bpb against x ("bytes" or "flops"), one line per run; False (nothing written) if no run has x."""
    series = [(r, [(p[x], p["val_bpb"]) for p in r["curve"] if _num(p[x])]) for r in runs]
    series = [(r, pts) for r, pts in series if pts]
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, pts in series:
        ax.plot(*zip(*pts), "o-", markersize=3, label=f"{r['name']} ({r['label']})")
    if any(pts[-1][0] > 10 * pts[0][0] for _, pts in series if len(pts) > 1):
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation bits per byte")
    ax.set_title(f"validation bpb against {xlabel}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_sources(runs: list[dict], sources: list[str], path: Path) -> bool:
    """One panel per data source: its validation bpb against training bytes, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sources), figsize=(4.5 * len(sources), 4), squeeze=False)
    for ax, source in zip(axes[0], sources):
        for r in runs:
            pts = [(p["bytes"], p["by_source"][source]) for p in r["curve"]
                   if _num(p["bytes"]) and _num(p["by_source"].get(source))]
            if pts:
                ax.plot(*zip(*pts), "o-", markersize=3, label=r["name"])
        ax.set_title(source if len(source) <= 40 else "..." + source[-37:], fontsize=9)
        ax.set_xlabel("training bytes seen")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("validation bits per byte")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- per language

def evaluate_run(run: dict, docs: list, *, boundary: str, seed: int, batch_size: int, device: str) -> dict:
    """A run's latest checkpoint on documents, as megatok-evaluate: by_lang -> bytes, bpb, bytes_per_unit.
    For the BPE token model bpb is the summed token NLL over the same UTF-8 bytes (megatok.model.token_lm)."""
    model, cfg, tag = load_model(run["run"], None, device)
    res = evaluate_documents(model, iter(docs), seq_len=cfg.data.seq_len, batch_size=batch_size,
                             mode=boundary, seed=seed, device=device, encoding=encoding_for(cfg))
    unit = "token" if cfg.model.kind == "bpe" else "chunk"
    by_lang = {lang: {"documents": v["documents"], "bytes": v["bytes"], "bpb": v["bpb"],
                      "bytes_per_unit": v[f"bytes_per_{unit}"]} for lang, v in res.get("by_lang", {}).items()}
    rule = boundary_rule(boundary, seed) if unit == "chunk" else "BPE tokens"
    return {"checkpoint": tag, "boundary_rule": rule, "unit": unit,
            "bpb": res["bpb"], "bytes_per_unit": res[f"bytes_per_{unit}"], "by_lang": by_lang}


def evaluate_tokenizer(path: str, docs: list) -> dict:
    sp = load_tokenizer(path)
    res = bytes_per_token(sp, docs)
    by_lang = {lang: {"documents": v["documents"], "bytes": v["bytes"], "bpb": None,
                      "bytes_per_unit": v["bytes_per_token"]} for lang, v in res.get("by_lang", {}).items()}
    return {"tokenizer": str(path), "vocab_size": sp.get_piece_size(), "unit": "token",
            "bytes_per_unit": res["bytes_per_token"], "by_lang": by_lang}


def _add_derived(system: dict) -> None:
    """units (chunks or tokens) and bits per language, and the disparities across languages."""
    for v in system["by_lang"].values():
        v["units"] = v["bytes"] / v["bytes_per_unit"] if _num(v["bytes_per_unit"]) else None
        v["bits"] = v["bpb"] * v["bytes"] if _num(v.get("bpb")) is not None else None
    system["disparity"] = {k: disparity({lang: v[k] for lang, v in system["by_lang"].items() if _num(v[k])})
                           for k in ("bytes_per_unit", "units", "bpb", "bits")}


def language_tables(systems: list[dict], langs: list[str], lang_bytes: dict[str, int]) -> str:
    """Two markdown tables over languages, each with a max/min (disparity) row: bytes per unit and bpb;
    units and kbits for each language's version of the same content."""
    def col(s, key, scale=1.0):
        vals = [s["by_lang"].get(lang, {}).get(key) for lang in langs]
        return [v / scale if _num(v) is not None else None for v in vals]

    t1 = [("bytes", [lang_bytes[lang] for lang in langs], disparity(lang_bytes), ",.0f")]
    t2 = []
    for s in systems:
        t1.append((f"{s['name']} bytes/{s['unit']}", col(s, "bytes_per_unit"), s["disparity"]["bytes_per_unit"], ".2f"))
        t2.append((f"{s['name']} {s['unit']}s", col(s, "units"), s["disparity"]["units"], ",.0f"))
        if any(_num(v.get("bpb")) is not None for v in s["by_lang"].values()):
            t1.append((f"{s['name']} bpb", col(s, "bpb"), s["disparity"]["bpb"], ".3f"))
            t2.append((f"{s['name']} kbits", col(s, "bits", 1000.0), s["disparity"]["bits"], ".2f"))

    def render(table):
        lines = ["| lang | " + " | ".join(c[0] for c in table) + " |", "|---|" + "---:|" * len(table)]
        for i, lang in enumerate(langs):
            lines.append(f"| {lang} | " + " | ".join(_fmt(c[1][i], c[3]) for c in table) + " |")
        lines.append("| **max/min** | " + " | ".join(_fmt(c[2], ".2f") for c in table) + " |")
        return "\n".join(lines)

    return render(t1) + "\n\n" + render(t2)


def plot_languages(systems: list[dict], langs: list[str], path: Path) -> bool:
    """Two panels over languages: bytes per unit (chunk or token) and bits per byte, one bar per system."""
    if not systems or not langs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(min(14, max(7, 0.25 * len(langs) * len(systems) + 3)), 6), sharex=True)
    width = 0.8 / len(systems)
    for panel, (key, label) in zip(axes, (("bytes_per_unit", "UTF-8 bytes per chunk / token"),
                                          ("bpb", "bits per byte"))):
        for i, s in enumerate(systems):
            vals = [s["by_lang"].get(lang, {}).get(key) for lang in langs]
            if all(_num(v) is None for v in vals):
                continue
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(langs))]
            panel.bar(xs, [v if _num(v) is not None else 0 for v in vals], width,
                      label=f"{s['name']} ({s['unit']}s)")
        panel.set_ylabel(label)
        panel.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("per language on the same (parallel) text")
    axes[1].set_xticks(range(len(langs)), langs)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main

def compare(run_dirs: list[str], out: str | Path, *, heldout: str | None = None, tokenizer: str | None = None,
            boundary: str = "sample", seed: int = 0, batch_size: int = 8, device: str | None = None) -> dict:
    """compare.md, compare.json and the plots in ``out`` for the runs (see the module docstring), printed
    too; with ``heldout``, every run with a checkpoint evaluated per language (``boundary`` rule, ``seed``,
    ``batch_size``, ``device``: default cuda if available) and ``tokenizer`` measured on the same text.
    Returns compare.json's content. DataError, FileNotFoundError or ValueError (one line) on bad input,
    before anything is written."""
    out = Path(out)
    docs = _heldout_documents(heldout) if heldout else None
    if tokenizer and not Path(tokenizer).exists():
        raise DataError(f"{tokenizer}: no such tokenizer model")
    runs = [load_run(r) for r in run_dirs]
    _distinct_names(runs)
    if heldout:  # what the per-language evaluation needs, before anything is evaluated or written
        for r in runs:
            if r["kind"] == "bpe" and r["has_checkpoint"]:
                _check_tokenizer(r)
    out.mkdir(parents=True, exist_ok=True)
    result = {"runs": runs}
    md = ["# Run comparison", "", runs_table(runs), ""]
    differences = config_differences(runs) if len(runs) > 1 else {}
    if differences:
        md += ["## Where the configurations differ", "", differences_table(runs, differences), ""]
    result["config_differences"] = differences
    plots = []
    if plot(runs, "bytes", out / "val_bpb_vs_bytes.png", "training bytes seen"):
        plots.append("val_bpb_vs_bytes.png")
    if plot(runs, "flops", out / "val_bpb_vs_flops.png", "training FLOPs"):
        plots.append("val_bpb_vs_flops.png")
    md += [f"![{p[:-4]}]({p})" for p in plots] + [""]
    sources = list(dict.fromkeys(s for r in runs for s in r["by_source"]))
    if sources:  # runs trained on a data mixture
        md += ["## Validation bpb by data source", "", sources_table(runs, sources), ""]
        if plot_sources(runs, sources, out / "val_bpb_by_source.png"):
            plots.append("val_bpb_by_source.png")
            md += ["![val_bpb_by_source](val_bpb_by_source.png)", ""]
    for r in runs:
        if not r["curve"]:
            md.append(f"- {r['name']}: no validation rows yet")
    if heldout:
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        evaluation = {"boundary": boundary, "seed": seed, "batch_size": batch_size, "device": device}
        md += _heldout_section(heldout, tokenizer, out, evaluation, runs, result, docs)
        plots += result.pop("plots_heldout", [])
    result["plots"] = plots
    (out / "compare.md").write_text("\n".join(md).rstrip() + "\n")
    (out / "compare.json").write_text(json.dumps(finite_or_none(result), indent=1, default=str) + "\n")
    print("\n".join(md))
    print(f"\nwrote {out / 'compare.md'}, {out / 'compare.json'}" + "".join(f", {out / p}" for p in plots))
    return result


def _heldout_documents(heldout: str) -> list:
    """The held-out documents, read whole (a bad line fails now); each language's needs a "lang"."""
    list_input_files([heldout])
    docs = list(iter_documents([heldout]))
    if not docs:
        raise DataError(f"{heldout}: no documents")
    if not any(d.lang for d in docs):
        raise DataError(f"{heldout}: no document has a \"lang\", and --heldout compares languages "
                        f"(use megatok-evaluate for text without one)")
    return docs


def _distinct_names(runs: list[dict]) -> None:
    """Runs are named by their directory; two of the same name (runs/a/megatok, runs/b/megatok) get as many
    parent directories as tell them apart."""
    for depth in range(2, 64):
        names = [r["name"] for r in runs]
        clash = {n for n in names if names.count(n) > 1}
        if not clash:
            return
        for r in runs:
            if r["name"] in clash:
                r["name"] = "/".join(Path(r["run"]).resolve().parts[-depth:])


def _check_tokenizer(run: dict) -> None:
    try:
        encoding_for(run_config(run["run"]))
    except ConfigError as e:
        raise DataError(f"{run['run']}: {e}") from None


def _heldout_section(heldout: str, tokenizer: str | None, out: Path, evaluation: dict, runs: list[dict],
                     result: dict, docs: list) -> list[str]:
    """The per-language section: every run with a checkpoint evaluated (``evaluation``: evaluate_run's
    settings), and the tokenizer measured."""
    langs, lang_bytes, lang_docs = [], {}, {}
    for d in docs:
        lang = d.lang or "unknown"
        if lang not in lang_bytes:
            langs.append(lang)
            lang_bytes[lang], lang_docs[lang] = 0, 0
        lang_bytes[lang] += len(d.text)
        lang_docs[lang] += 1
    systems, notes = [], []
    for r in runs:
        if r["has_checkpoint"]:
            systems.append({"name": r["name"], **evaluate_run(r, docs, **evaluation)})
        else:
            notes.append(f"- {r['name']}: no checkpoint, not evaluated per language")
    if tokenizer:
        systems.append({"name": "BPE", **evaluate_tokenizer(tokenizer, docs)})
    for s in systems:
        _add_derived(s)
    result["heldout"] = {"file": heldout, "languages": langs, "bytes": lang_bytes, "documents": lang_docs,
                         "systems": systems}
    counts = sorted(set(lang_docs.values()))
    md = ["", f"## Per language on {heldout}", "",
          f"{len(langs)} languages, {'/'.join(map(str, counts))} documents per language"
          + (" (the same number in every language)" if len(counts) == 1 else " (NOT the same in every language)")
          + ". bytes/unit: UTF-8 bytes per chunk (megatok) or per token (BPE); bpb: bits per byte. "
          "Units and kbits: chunks or tokens, and total bits, for each language's version of the same text. "
          "max/min: largest over smallest value across languages (the disparity).", ""]
    for s in systems:
        if "boundary_rule" in s:
            md.append(f"- {s['name']}: checkpoint {s['checkpoint']}, boundaries {s['boundary_rule']}")
        elif "tokenizer" in s:
            md.append(f"- BPE: {s['tokenizer']} ({s['vocab_size']} pieces)")
    md += notes + [""]
    if systems:
        if plot_languages(systems, langs, out / "per_language.png"):
            result["plots_heldout"] = ["per_language.png"]
            md += ["![per language](per_language.png)", ""]
        md.append(language_tables(systems, langs, lang_bytes))
        md += ["", "| system | bytes/unit max/min | units max/min | bpb max/min | bits max/min |",
               "|---|---:|---:|---:|---:|"]
        for s in systems:
            d = s["disparity"]
            md.append(f"| {s['name']} ({s['unit']}) | {_fmt(d['bytes_per_unit'], '.2f')} | {_fmt(d['units'], '.2f')} | "
                      f"{_fmt(d['bpb'], '.2f')} | {_fmt(d['bits'], '.2f')} |")
    else:
        md.append("No run could be evaluated per language (no checkpoints) and no --tokenizer given.")
    return md

