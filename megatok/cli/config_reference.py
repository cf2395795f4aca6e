"""megatok-config-reference: the command line of megatok.config_reference (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok import config_reference
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=config_reference.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="FILE", help="compare with the copy between the markers in this file")
    ap.add_argument("--write", metavar="FILE", help="replace the copy between the markers in this file")
    args = ap.parse_args(argv)
    if not (args.check or args.write):
        print(config_reference.reference(), end="")
        return 0
    return config_reference.sync(args.check or args.write, write=bool(args.write))


if __name__ == "__main__":
    sys.exit(main())
