"""megatok-train-bpe: the command line of megatok.data.tokenizer (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok import bpe
from megatok.data import tokenizer
from megatok.data.documents import DataError
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=tokenizer.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, nargs="+", help="files, directories, or a shard directory (train split)")
    ap.add_argument("--vocab-size", type=int, required=True, help="number of pieces (256 byte pieces and 3 specials included)")
    ap.add_argument("--out", required=True, help="output directory (tokenizer.model, report.json)")
    ap.add_argument("--max-mb", type=float, default=None, help="train on at most this many MB of text (decimal)")
    ap.add_argument("--heldout", nargs="+", default=[], help="held-out files to report bytes per token on")
    ap.add_argument("--character-coverage", type=float, default=bpe.SP_OPTIONS["character_coverage"],
                    help="fraction of characters the vocabulary must cover; the rest fall back to bytes")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing OUT/tokenizer.model")
    args = ap.parse_args(argv)
    try:
        tokenizer.train(args.data, args.vocab_size, args.out, max_mb=args.max_mb, heldout=args.heldout,
                        character_coverage=args.character_coverage, overwrite=args.overwrite)
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
