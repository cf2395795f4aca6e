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
import sys
from pathlib import Path

from megatok.eval.segments import show_boundaries
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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

    try:
        data = args.text.encode("utf-8") if args.text is not None else Path(args.data).read_bytes()[:args.max_bytes]
        if not data:
            ap.error("the text is empty")
        show_boundaries(data, args.run, args.strategy, boundary=args.boundary, seed=args.seed, seq_len=args.seq_len,
                        rate=args.rate, sep=args.sep, out=args.out, width=args.width, title=args.title)
    except (OSError, ValueError) as e:  # a missing run, file or tokenizer, a config or option refused
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
