"""megatok-estimator-variance: the command line of megatok.studies.estimator_variance (its docstring is
the help)."""

from __future__ import annotations

import argparse
import json
import sys

from megatok.data.documents import DataError
from megatok.studies import StudyError, estimator_variance
from megatok.cli import command_parser


def parse_variant(text: str) -> tuple[str, dict]:
    """NAME=KEY:VALUE,KEY:VALUE -> (NAME, {KEY: VALUE}) with JSON values (true, 2, 0.9); NAME= is the run's own."""
    name, eq, rest = text.partition("=")
    if not name or not eq:
        raise ValueError(f"--variant {text!r}: expected NAME=KEY:VALUE,... (NAME= alone: the run's own options)")
    update = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY:VALUE")
        try:
            update[key] = json.loads(value)
        except json.JSONDecodeError:
            update[key] = value
    return name, update


def main(argv=None) -> int:
    ap = command_parser(description=estimator_variance.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory of a policy run")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag (default: latest)")
    ap.add_argument("--gammas", default="0.9,0.95,0.99,1.0", help="one variant per gamma (without --variant)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE,...",
                    help="an estimator variant: the run's policy options with these replaced (repeatable)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the run's data.seq_len")
    ap.add_argument("--data", default=None, help="shard directory (val split) or text files; default: the run's data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output prefix (default RUN/estimator_variance)")
    args = ap.parse_args(argv)
    if args.samples < 2:
        ap.error("--samples must be at least 2")
    try:
        gammas = [float(g) for g in args.gammas.split(",") if g]
    except ValueError:
        ap.error(f"--gammas {args.gammas}: expected numbers like 0.99,1.0")
    if not gammas or not all(0 <= g <= 1 for g in gammas):
        ap.error("--gammas: values in [0, 1]")
    try:
        variants = dict(map(parse_variant, args.variant)) or {f"{g:g}": {"gamma": g} for g in gammas}
    except ValueError as e:
        ap.error(str(e))
    try:
        estimator_variance.study(args.run, variants, checkpoint=args.checkpoint, samples=args.samples,
                                 batch_size=args.batch_size, seq_len=args.seq_len, data=args.data, seed=args.seed,
                                 out=args.out)
    except (FileNotFoundError, StudyError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
