"""Where chunks start on a text: the segmentation a run's model, or a rule that needs no training, gives
it, window by window as an evaluation document is read, with its figures on that text (megatok.stats);
shown on the terminal and written as HTML and PNG (megatok.display) by megatok-show-boundaries."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatok.display import characters, terminal, write_html, write_png
from megatok.stats import ratios, row_stats
from megatok.vocab import SEP

RULES = ("fixed", "uniform", "whitespace", "bpe")


@dataclass
class Row:
    label: str
    starts: list[bool]  # one per byte of the text
    figures: dict


def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    return state


def boundaries_for_run(run: str, data: bytes, mode: str, seed: int, seq_len: int | None) -> Row:
    from megatok.run.reader import load_model, run_config

    if run_config(run).model.kind == "bpe":
        raise ValueError(f"{run}: a BPE token model, whose units are its tokenizer's tokens, has no chunk "
                         f"boundaries to show (for its tokenizer's segmentation: --strategy bpe:model_path=...)")
    model, cfg, tag = load_model(run)
    model.boundary.eval_mode = mode
    return _segment(lambda x: model(x).boundaries.starts, data, seq_len or cfg.data.seq_len, seed,
                    f"{Path(run).name} ({cfg.boundary.strategy}, {tag})")


def boundaries_for_rule(spec: str, data: bytes, seed: int, seq_len: int, rate: float) -> Row:
    from megatok.boundaries import build_strategy

    name, _, opts = spec.partition(":")
    if name not in RULES:
        raise ValueError(f"--strategy {name}: only rules that need no training ({', '.join(RULES)}); "
                         f"learned strategies need --run")
    options = {}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        try:
            options[k] = json.loads(v)
        except json.JSONDecodeError:
            options[k] = v
    try:
        strat = build_strategy(name, d_model=1, target_rate=rate, options=options).eval()
    except ValueError as e:  # the strategy's options schema (pydantic), or a tokenizer that cannot be used
        errs = e.errors() if hasattr(e, "errors") else None
        what = f"{'.'.join(map(str, errs[0]['loc']))}: {errs[0]['msg']}" if errs else str(e)
        raise ValueError(f"--strategy {spec}: {what}") from None
    files = strat.model_files(strat.options)  # (a tokenizer's path is no label)
    shown_opts = " ".join(f"{k}={v}" for k, v in options.items() if k not in files)
    label = f"{name} {shown_opts}".strip() + " (rule)"
    return _segment(lambda x: strat(None, x, torch.ones_like(x, dtype=torch.bool)).starts, data, seq_len, seed,
                    label)


@torch.no_grad()
def _segment(decide, data: bytes, seq_len: int, seed: int, label: str) -> Row:
    ids = torch.tensor([SEP] + list(data), dtype=torch.long)
    starts: list[bool] = []
    stats: dict[str, float] = {}
    for i, begin in enumerate(range(0, len(data), seq_len)):  # windows of seq_len bytes, each after its context id
        x = ids[begin:begin + seq_len + 1][None]
        state = _seeded(seed * 1_000_003 + i)
        try:
            s = decide(x)
        finally:
            torch.random.set_rng_state(state)
        starts += s[0, 1:].tolist()
        zero = torch.zeros(x.shape)
        for k, v in row_stats(x[:, 1:], x[:, 1:], s[:, 1:], zero[:, 1:], zero[:, 1:]).items():
            stats[k] = stats.get(k, 0.0) + float(v.sum())
    r = ratios(stats)
    figures = {k: r[k] for k in ("boundary_rate", "bytes_per_chunk", "whitespace_boundary_fraction",
                                 "word_start_precision", "word_start_recall")}
    return Row(label, starts, figures)


# --------------------------------------------------------------------------- characters


def show_boundaries(data: bytes, runs: list[str], strategies: list[str], *, boundary: str = "sample", seed: int = 0,
                    seq_len: int | None = None, rate: float = 0.2, sep: str = "│", out: str | None = None,
                    width: int = 80, title: str | None = None) -> None:
    """One row per run directory in ``runs`` (its latest checkpoint; ``boundary`` "sample" or "threshold")
    and per rule in ``strategies`` ("NAME[:KEY=VALUE,...]", windows of ``seq_len`` or 512 bytes), printed
    on stdout; with ``out``, also written to OUT.html and OUT.png (``width`` characters a line).
    OSError or ValueError (one line) for a run, file, tokenizer, config or option that cannot be used."""
    rows = [boundaries_for_run(run, data, boundary, seed, seq_len) for run in runs]
    rows += [boundaries_for_rule(spec, data, seed, seq_len or 512, rate) for spec in strategies]
    chars = characters(data)
    rule = f"sample(seed={seed})" if boundary == "sample" else boundary
    sys.stdout.write(terminal(rows, data, sep))
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        title = title or f"chunk boundaries ({rule})"
        write_html(rows, chars, width, out.with_suffix(".html"), title)
        write_png(rows, chars, width, out.with_suffix(".png"), title)
        print(f"wrote {out.with_suffix('.html')} and {out.with_suffix('.png')}", file=sys.stderr)
