"""megatok-replicate: the command line of megatok.studies.replicate (its docstring is the help)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from megatok.studies import replicate
from megatok.studies.control import LEVELS as CONTROL_LEVELS
from megatok.studies.replication import METHODS, PRESETS, Handover
from megatok.cli import command_parser


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: a count N (seeds 0..N-1), a range A-B (seeds A to B, both included) or a comma-separated
    list of seeds."""
    first, dash, last = text.strip().partition("-")
    if dash and first.isdigit() and last.isdigit():
        if int(last) < int(first):
            raise argparse.ArgumentTypeError(f"a range of seeds goes up: {text!r}")
        return list(range(int(first), int(last) + 1))
    items = [t for t in text.split(",") if t.strip()]
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or a comma-separated list of seeds, not {text!r}") from None
    if len(values) == 1 and "," not in text:
        if values[0] < 1:
            raise argparse.ArgumentTypeError("a count of seeds must be at least 1")
        return list(range(values[0]))
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"seeds must be distinct and not negative: {text!r}")
    return values


def parse_levels(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], not {text!r}") from None
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"levels are numbers in [0, 1]: {text!r}")
    return sorted(set(values))


def parse_handover(text: str) -> Handover:
    """``--handover METHOD:STEPS``: a byte method of METHODS and a positive number of steps."""
    method, _, steps = text.partition(":")
    if method not in METHODS or method == "bpe" or not steps.isdigit() or int(steps) < 1:
        byte_methods = ",".join(m for m in METHODS if m != "bpe")
        raise argparse.ArgumentTypeError(f"expected METHOD:STEPS with a byte method ({byte_methods}) and a positive "
                                         f"number of steps, such as whitespace:200; not {text!r}")
    return Handover(method, int(steps))


def parse_args(argv):
    ap = command_parser(description=replicate.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path, help="results directory (tables, plots, results.json)")
    ap.add_argument("--work", type=Path, default=None, help="runs, configs and data (default runs/replicate-PRESET)")
    ap.add_argument("--seeds", type=parse_seeds, default=[0], help="a count N (seeds 0..N-1), a range such as 20-39 "
                                                                   "or a list such as 5,11,17 (default 1)")
    ap.add_argument("--level", dest="levels", type=parse_levels, default=None,
                    help="--preset control: the corpus's level(s), comma-separated (default: the preset's, "
                         f"{','.join(f'{v:g}' for v in CONTROL_LEVELS)})")
    ap.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} "
                                                    "(default: the preset's)")
    ap.add_argument("--nproc", type=int, default=None, help="ranks per training run (default: the preset's)")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run")
    ap.add_argument("--shards", default=None, help="shard directory to train on instead of the preset's")
    ap.add_argument("--heldout", nargs="+", default=None, help="held-out prose documents (.jsonl with domain)")
    ap.add_argument("--parallel", nargs="+", default=None, help="parallel multilingual documents (.jsonl with lang)")
    ap.add_argument("--handover", type=parse_handover, default=None, metavar="METHOD:STEPS",
                    help="every method starts from METHOD's step-STEPS checkpoint of its seed (trained first) and "
                         "trains the preset's remaining steps; give it its own --out")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: evaluate the finished runs and write the tables of the study so far")
    ap.add_argument("--prepare-only", action="store_true",
                    help="build the data and write the runs' configs under --work; train and write nothing else "
                         "(to carry the data to another machine)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                    help="the study's wall-clock budget: no run starts or is evaluated in its last 90 s, and a run "
                         "still training 60 s before its end is stopped at a checkpoint; the tables then hold what "
                         "finished and the same command resumes (exit status 3)")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.budget_s is not None and not args.budget_s > 0:
        ap.error(f"--budget-s: a positive number of seconds, not {args.budget_s:g}")
    args.methods = args.methods.split(",") if args.methods else list(preset.methods)
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {','.join(bad)}; choose from {','.join(METHODS)}")
    if args.handover and ("bpe" in args.methods or preset.data == "control"):
        ap.error("--handover hands a byte model over between boundary strategies on prose: not the bpe method, "
                 "not --preset control")
    if preset.data == "control":
        if args.shards or args.heldout or args.parallel:
            ap.error("--preset control builds its own data: --shards, --heldout and --parallel do not apply")
        args.levels = args.levels or list(CONTROL_LEVELS)
    elif args.levels is not None:
        ap.error("--level is for --preset control")
    else:
        args.levels = [None]
    return args, preset


def main(argv=None) -> int:
    args, preset = parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    recorded = []  # the study's command: what only says how much of it to do now is left out
    while given:
        a = given.pop(0)
        if a == "--budget-s":
            given = given[1:]
        elif a not in ("--report-only", "--prepare-only") and not a.startswith("--budget-s="):
            recorded.append(a)
    return replicate.run_study(
        preset, out=args.out.resolve(), work=(args.work or Path("runs") / f"replicate-{preset.name}").resolve(),
        nproc=args.nproc or preset.nproc, seeds=args.seeds, levels=args.levels, methods=args.methods,
        overrides=args.overrides, given={"shards": args.shards, "heldout": args.heldout, "parallel": args.parallel},
        report_only=args.report_only, invocation="megatok-replicate " + shlex.join(recorded), handover=args.handover,
        prepare_only=args.prepare_only, budget_s=args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
