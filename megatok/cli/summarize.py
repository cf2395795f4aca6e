"""megatok-summarize: the command line of megatok.studies.summarize (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok.config import ConfigError
from megatok.data.documents import DataError
from megatok.studies import StudyError, summarize
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=summarize.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", default=None, help="shard directory (default: the run's data.shards; a mixture's sources one after another)")
    ap.add_argument("--eval", default=None, help="megatok-evaluate output (default: RUN/eval.json if present)")
    args = ap.parse_args(argv)
    try:
        summarize.summarize(args.run, args.data, args.eval)
    except (StudyError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
