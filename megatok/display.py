"""Text with chunk starts marked, for terminals (megatok-show-boundaries, megatok-generate's samples), and
as an HTML page and a PNG: one row per segmentation (``rows``: objects with a ``label``, ``starts``, one per
byte, and ``figures``, as megatok.eval.segments makes them), line by line."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path


def characters(data: bytes) -> list[tuple[int, int, str]]:
    """(first byte, byte count, shown text) per character; invalid bytes shown as \\xNN."""
    out, i = [], 0
    while i < len(data):
        for n in (1, 2, 3, 4):
            try:
                ch = data[i:i + n].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        else:
            n, ch = 1, f"\\x{data[i]:02x}"
        out.append((i, n, ch))
        i += n
    return out


def char_marks(chars, starts: list[bool]) -> list[str]:
    """Per character: "start" (a chunk starts at its first byte), "inside" (at a later byte), or ""."""
    marks = []
    for first, n, _ in chars:
        if starts[first]:
            marks.append("start")
        elif any(starts[first + 1:first + n]):
            marks.append("inside")
        else:
            marks.append("")
    return marks


def marked(data: bytes, starts: list[bool], sep: str = "│") -> str:
    """``data`` as text with ``sep`` before every chunk after the first, and "¦" before a character
    inside which a chunk starts (a boundary between the bytes of one UTF-8 character)."""
    chars = characters(data)
    out = []
    for (first, n, ch), mark in zip(chars, char_marks(chars, starts)):
        if mark and first > 0:
            out.append(sep if mark == "start" else "¦")
        out.append("↵\n" if ch == "\n" else ch)
    return "".join(out)


def shown(ch: str) -> str:
    return {"\n": "↵", "\t": "→", "\r": "␍", " ": "·"}.get(ch, ch if ch.isprintable() else "�")


def terminal(rows, data: bytes, sep: str) -> str:
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


def write_html(rows, chars, width: int, path: Path, title: str) -> None:
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


def write_png(rows, chars, width: int, path: Path, title: str) -> None:
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



def sample(g, prompt: bytes, i: int, seed: int, *, as_json: bool = False, chunks: bool = False, sep: str = "│",
           byte_model: bool = True) -> str:
    """megatok-generate's output for sample ``i`` (seed ``seed``; its prompt's bytes, its Generation ``g``):
    a header line and the prompt and text (``chunks``: the byte model's chunk starts marked with ``sep``),
    or one JSON object (the text and prompt as UTF-8, an invalid byte as U+FFFD, and exactly, in base64)."""
    if as_json:
        row = {"sample": i, "seed": seed, "prompt": prompt.decode("utf-8", "replace"),
               "text": g.text.decode("utf-8", "replace"), "bytes": len(g.text), "stopped": g.stopped,
               "bits_per_byte": round(g.bits_per_byte, 4), "prompt_base64": base64.b64encode(prompt).decode(),
               "text_base64": base64.b64encode(g.text).decode()}
        if byte_model:
            row["chunk_starts"] = [j for j, start in enumerate(g.starts) if start]
        return json.dumps(row, ensure_ascii=False)
    text = (marked(prompt + g.text, g.prompt_starts + g.starts, sep) if chunks
            else (prompt + g.text).decode("utf-8", "replace"))
    stopped = ", stopped at a separator" if g.stopped else ""
    return (f"== sample {i + 1} (seed {seed}): {len(g.text)} bytes{stopped}, {g.bits_per_byte:.3f} bits/byte\n"
            f"{text}")
