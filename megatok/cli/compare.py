"""megatok-compare: the command line of megatok.studies.compare (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok.data.documents import DataError
from megatok.studies import compare
from megatok.cli import add_device, command_parser, device_or_default


def main(argv=None) -> int:
    ap = command_parser(description=compare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (config.json, metrics.jsonl)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--heldout", default=None, help="held-out documents with \"lang\" (e.g. data/heldout_udhr.jsonl)")
    ap.add_argument("--tokenizer", default=None, help="a BPE tokenizer.model (megatok-train-bpe) to measure on --heldout")
    ap.add_argument("--boundary", choices=["sample", "threshold"], default="sample",
                    help="boundary rule for the per-language evaluation (as megatok-evaluate)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    add_device(ap)
    args = ap.parse_args(argv)
    args.device = device_or_default(args.device)
    if args.tokenizer and not args.heldout:
        ap.error("--tokenizer needs --heldout (the text to measure it on)")
    try:
        compare.compare(args.runs, args.out, heldout=args.heldout, tokenizer=args.tokenizer, boundary=args.boundary,
                        seed=args.seed, batch_size=args.batch_size, device=args.device)
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
