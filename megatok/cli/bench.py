"""megatok-bench: the command line of megatok.perf.bench and, with --inference, of
megatok.perf.bench_inference (their docstrings are the help)."""

from __future__ import annotations

import argparse
import sys


from megatok.perf import bench, bench_estimators, bench_inference
from megatok.cli import add_device, command_parser, device_or_default


def build_parser() -> argparse.ArgumentParser:
    """The command line (tools/gpu_bench.sh's commands are checked against it)."""
    d = bench.Settings()
    docs = (bench.__doc__, bench_inference.__doc__, bench_estimators.__doc__)
    ap = command_parser(description="\n".join(docs),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=d.config, help="base config (default configs/tiny.json)")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="applied to every variant")
    ap.add_argument("--shapes", nargs="+", default=None, choices=list(bench.SHAPES),
                    help="default: tiny small on a CPU, tiny small 100m on a GPU; the first one also serves the data, "
                         "evaluation, generation and head-to-head figures")
    ap.add_argument("--hot-path", action=argparse.BooleanOptionalAction, default=None,
                    help="also time document masking (FlexAttention and the dense mask) and a fixed chunk capacity "
                         "(no host sync) on the last shape (default: on a GPU)")
    add_device(ap)
    ap.add_argument("--threads", type=int, default=d.threads, help="CPU threads (default 1: the machine may be shared)")
    ap.add_argument("--reps", type=int, default=d.reps, help="rounds of the interleaved timings")
    ap.add_argument("--steps", type=int, default=d.steps, help="training steps per variant per round")
    ap.add_argument("--eval-bytes", type=int, default=d.eval_bytes, help="bytes evaluate_documents scores per round")
    ap.add_argument("--gen-bytes", type=int, default=d.gen_bytes, help="bytes generated per round")
    ap.add_argument("--h2h-bytes", type=int, default=d.h2h_bytes, help="held-out bytes of the timed head-to-head")
    ap.add_argument("--matmul", type=int, default=None, help="matmul size (default 1024 on a CPU, 8192 on a GPU)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 2 steps, fewer bytes: a smoke run")
    ap.add_argument("--json-out", default=None,
                    help="write the report as JSON here: at every stage of the set-up, after every round and when "
                         "SIGTERM ends the bench (``stage`` says how far it got, ``stopped`` why it ended early)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no round after this many seconds (the rounds done are reported; at least one runs)")
    ap.add_argument("--inference", action="store_true",
                    help="instead: generation bytes/s of the byte model and its matched BPE model at batch 1 and 8")
    ap.add_argument("--vocab", type=int, default=d.vocab, help="--inference: the matched BPE model's vocabulary")
    ap.add_argument("--generation-step", choices=list(bench.GENERATION_STEPS), default=d.generation_step,
                    help="--inference: each step as cached (the default), static (fixed shapes) or compile (the "
                         "static step through torch.compile, compiled in the warm-up round)")
    ap.add_argument("--estimators", default=None, metavar="METHOD,...",
                    help="instead: seconds per training step of these megatok-replicate methods on --config, and each "
                         "against the first (e.g. policy-published,policy,policy-disarm)")
    ap.add_argument("--profile", default=None, metavar="SHAPE/VARIANT",
                    help="instead: --steps training steps of one variant under torch.profiler, their time by part "
                         "(byte layers, main network, attention, policy, heads and losses, optimizer, communication, "
                         "host and idle), e.g. small/policy; with --json-out, the table as JSON and a Chrome trace")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.device = device_or_default(args.device)
    args = vars(args)
    try:
        settings = bench.Settings(**args)
    except ValueError as e:
        ap.error(str(e))
    if settings.estimators is not None:
        return bench_estimators.run(settings, [m for m in settings.estimators.split(",") if m])
    return (bench_inference if settings.inference else bench).run(settings)


if __name__ == "__main__":
    sys.exit(main())
