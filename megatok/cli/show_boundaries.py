"""Show where chunks start: the terminal, an HTML page and a PNG, one row per run, line by line.

    megatok-show-boundaries --run runs/strat-policy --text "The quick brown fox."
    megatok-show-boundaries --run runs/a --run runs/b --strategy whitespace --data notes.txt --out docs/cmp

Each ``--run`` is a run directory (its latest checkpoint, loaded like megatok-evaluate); each
``--strategy NAME[:KEY=VALUE,...]`` is a rule that needs no training (fixed, uniform, whitespace, bpe),
e.g. ``--strategy bpe:model_path=data/bpe-32k.model``. The text is read like an evaluation document: a
SEP first, then its bytes, in windows of the run's data.seq_len. Boundaries are sampled with a fixed
seed (``--boundary sample``, the default) or chosen by the deterministic rule (``threshold``).

The terminal shows every segmentation with a visible separator (default "│") before each chunk; a
chunk that starts inside a multi-byte character is marked "¦" before that character. ``--out PREFIX``
writes PREFIX.html and PREFIX.png, where the text is wrapped to ``--width`` columns and every line
shows one row per run, chunks in alternating colours with a bar where each starts. Also prints the
figures of each row on this text: boundary rate, bytes per chunk, precision/recall against word
starts (megatok.stats).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatok.display import char_marks, characters, marked
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
    from megatok.run.reader import load_model

    from megatok.run.reader import run_config

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
        raise SystemExit(f"error: --strategy {name}: only rules that need no training ({', '.join(RULES)}); "
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


def shown(ch: str) -> str:
    return {"\n": "↵", "\t": "→", "\r": "␍", " ": "·"}.get(ch, ch if ch.isprintable() else "�")


def terminal(rows: list[Row], data: bytes, sep: str) -> str:
    lines = []
    for row in rows:
        f = row.figures
        lines.append(f"== {row.label}: rate {f['boundary_rate']:.3f}, {f['bytes_per_chunk']:.2f} bytes/chunk, "
                     f"word starts P {f['word_start_precision']:.2f} R {f['word_start_recall']:.2f}")
        lines.append(marked(data, row.starts, sep))
    return "\n".join(lines) + "\n"


def wrap(chars, width: int) -> list[list[int]]:
    """Character indices per display line: break at newlines and every ``width`` characters."""
    lines, cur = [], []
    for i, (_, _, ch) in enumerate(chars):
        cur.append(i)
        if ch == "\n" or len(cur) == width:
            lines.append(cur)
            cur = []
    if cur:
        lines.append(cur)
    return lines


def chunk_ids(marks: list[str]) -> list[int]:
    ids, k = [], 0
    for i, m in enumerate(marks):
        if m == "start" and i > 0:
            k += 1
        ids.append(k)
        if m == "inside":
            k += 1  # the chunk that starts inside this character begins after it, for colouring
    return ids


COLOURS = ("#cfe3ff", "#ffe2b8")


def write_html(rows: list[Row], chars, width: int, path: Path, title: str) -> None:
    marks = [char_marks(chars, r.starts) for r in rows]
    ids = [chunk_ids(m) for m in marks]
    label_w = max(len(r.label) for r in rows)
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:monospace;font-size:14px}.l{color:#666;white-space:pre}"
             ".c{white-space:pre}.s{border-left:2px solid #c00}.i{border-left:2px dashed #c00}"
             "td{padding:0 4px}table{border-collapse:collapse}tr.gap td{height:8px}</style>",
             f"<h3>{html.escape(title)}</h3><table>"]
    for row in rows:
        f = row.figures
        parts.append(f"<tr><td class=l>{html.escape(row.label)}</td><td>rate {f['boundary_rate']:.3f}, "
                     f"{f['bytes_per_chunk']:.2f} bytes/chunk, word starts P {f['word_start_precision']:.2f} "
                     f"R {f['word_start_recall']:.2f}</td></tr>")
    parts.append("</table><br><table>")
    for line in wrap(chars, width):
        for r, row in enumerate(rows):
            cells = []
            for i in line:
                cls = {"start": " s", "inside": " i"}.get(marks[r][i], "")
                bg = COLOURS[ids[r][i] % 2]
                cells.append(f"<span class='c{cls}' style='background:{bg}'>{html.escape(shown(chars[i][2]))}</span>")
            parts.append(f"<tr><td class=l>{html.escape(row.label.ljust(label_w))}</td><td>{''.join(cells)}</td></tr>")
        parts.append("<tr class=gap><td></td></tr>")
    parts.append("</table><p>A red bar: a chunk starts at this character (dashed: inside it, at a later byte). "
                 "· space, ↵ newline, → tab.</p>")
    path.write_text("\n".join(parts), encoding="utf-8")


def write_png(rows: list[Row], chars, width: int, path: Path, title: str) -> None:
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    marks = [char_marks(chars, r.starts) for r in rows]
    ids = [chunk_ids(m) for m in marks]
    lines = wrap(chars, width)
    labels = [r.label.split(" (")[0] for r in rows]
    label_cols = max(len(s) for s in labels) + 2
    cols = label_cols + width + 2
    n_rows = len(lines) * (len(rows) + 1)
    char_in = 0.11  # inches per column
    fig = plt.figure(figsize=(cols * char_in, (n_rows + 3) * char_in * 2.1))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, cols)
    ax.set_ylim(n_rows + 3, 0)
    ax.axis("off")
    fontsize = char_in * 72 / 0.62
    ax.text(0.2, 1.0, title, fontsize=fontsize, family="monospace", va="center", weight="bold")
    y = 2.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs the font lacks (CJK...) show as boxes
        for line in lines:
            for r, row in enumerate(rows):
                ax.text(0.2, y, labels[r], fontsize=fontsize * 0.9, family="monospace", va="center", color="#555")
                for col, i in enumerate(line):
                    x = label_cols + col
                    ax.add_patch(Rectangle((x, y - 0.45), 1, 0.9, color=COLOURS[ids[r][i] % 2], lw=0))
                    ax.text(x + 0.5, y, shown(chars[i][2]), fontsize=fontsize, family="monospace", ha="center",
                            va="center")
                    if marks[r][i]:
                        ax.plot([x, x], [y - 0.5, y + 0.5], color="#c00", lw=1.2,
                                ls="-" if marks[r][i] == "start" else "--")
                y += 1
            y += 1
        fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", default=[], help="run directory (repeat to compare runs)")
    ap.add_argument("--strategy", action="append", default=[],
                    help="a rule without training: fixed, uniform, whitespace, bpe[:model_path=...] (repeatable)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to segment")
    src.add_argument("--data", help="a file: its first --max-bytes bytes are segmented")
    ap.add_argument("--max-bytes", type=int, default=600)
    ap.add_argument("--boundary", choices=["sample", "threshold"], default="sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=None, help="window length (default: each run's data.seq_len; rules 512)")
    ap.add_argument("--rate", type=float, default=0.2, help="target rate for --strategy rules (fixed, uniform)")
    ap.add_argument("--sep", default="│", help="separator shown before each chunk in the terminal")
    ap.add_argument("--width", type=int, default=80, help="characters per line in the HTML and PNG")
    ap.add_argument("--out", default=None, help="write OUT.html and OUT.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    if not args.run and not args.strategy:
        ap.error("give at least one --run or --strategy")

    rows = []
    try:
        data = args.text.encode("utf-8") if args.text is not None else Path(args.data).read_bytes()[:args.max_bytes]
        if not data:
            ap.error("the text is empty")
        for run in args.run:
            rows.append(boundaries_for_run(run, data, args.boundary, args.seed, args.seq_len))
        for spec in args.strategy:
            rows.append(boundaries_for_rule(spec, data, args.seed, args.seq_len or 512, args.rate))
    except (OSError, ValueError) as e:  # a missing run, file or tokenizer, a config or option refused
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2

    chars = characters(data)
    rule = f"sample(seed={args.seed})" if args.boundary == "sample" else args.boundary
    sys.stdout.write(terminal(rows, data, args.sep))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        title = args.title or f"chunk boundaries ({rule})"
        write_html(rows, chars, args.width, out.with_suffix(".html"), title)
        write_png(rows, chars, args.width, out.with_suffix(".png"), title)
        print(f"wrote {out.with_suffix('.html')} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
