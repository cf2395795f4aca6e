"""megatok-sweep: the command line of megatok.studies.sweep (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok import sizing
from megatok.config import ConfigError
from megatok.studies import sweep
from megatok.cli import command_parser


def main(argv=None) -> int:
    d = sweep.Settings(out="")
    ap = command_parser(description=sweep.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="sweep directory")
    ap.add_argument("--sizes", default=d.sizes, help="comma-separated config names or paths")
    ap.add_argument("--strategies", default=d.strategies,
                    help=f"comma-separated boundary strategies, and {sweep.BPE_LM} for the matched BPE token model")
    ap.add_argument("--bytes", type=sizing.positive(float), default=d.bytes, help="training bytes per run")
    ap.add_argument("--gpus", type=sizing.positive(int), default=d.gpus, help="GPUs per node for the generated jobs")
    ap.add_argument("--nodes", type=sizing.positive(int), default=d.nodes, help="nodes per job")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="applied to every run, e.g. data.shards=/shared/shards")
    ap.add_argument("--option", nargs="+", action="extend", default=[], metavar="STRATEGY.KEY=VALUE",
                    help="an option for one strategy's runs, e.g. bpe.model_path=data/bpe32k/tokenizer.model")
    ap.add_argument("--bpe-tokenizer", default=None,
                    help=f"{sweep.BPE_LM}: megatok-train-bpe output (directory or tokenizer.model); with --bpe-vocab-size "
                         f"and --bpe-bytes-per-token only the path written (default {sweep.DEFAULT_BPE_TOKENIZER})")
    ap.add_argument("--bpe-vocab-size", type=int, default=None, help=f"{sweep.BPE_LM}: tokenizer pieces")
    ap.add_argument("--bpe-bytes-per-token", type=float, default=None,
                    help=f"{sweep.BPE_LM}: expected bytes per token (default: the tokenizer's report.json)")
    ap.add_argument("--emit", choices=["sbatch"], help="print (and write OUT/submit.sh) the sbatch commands")
    ap.add_argument("--run-local", action="store_true", help="run the configs here, one after another")
    ap.add_argument("--nproc", type=sizing.positive(int), default=None, help="ranks for --run-local (default: GPUs here, else 1)")
    ap.add_argument("--collect", action="store_true", help="gather finished runs: OUT/results.md, OUT/loss_vs_flops.png")
    args = ap.parse_args(argv)
    try:
        return sweep.sweep(sweep.Settings(**vars(args)))
    except (sweep.SweepError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
