"""megatok-zero-init-check: the command line of megatok.perf.zero_init (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok import sizing
from megatok.config import ConfigError
from megatok.perf import zero_init
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=zero_init.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    ap.add_argument("--strategies", type=lambda s: s.split(","), default=None,
                    help="comma-separated boundary strategies (default: the config's)")
    ap.add_argument("--ranks", type=sizing.positive(int), default=2, help="CPU ranks (default 2)")
    ap.add_argument("--no-compare", action="store_true", help="only the zero.Init build (no whole copy to compare)")
    args = ap.parse_args(argv)
    try:  # a bad config or strategy fails here, before any process starts
        return zero_init.check(args.config, args.overrides, args.strategies, args.ranks, args.no_compare)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
