"""The value of one added boundary, by byte class, at any checkpoint of a byte model.

    megatok-boundary-value --run runs/x [--checkpoint step300 | all | TAG,TAG] [--gamma 0.99] [--rounds 8]
                           [--batch-size 16] [--seq-len N] [--data DIR_OR_FILES] [--seed 0] [--out FILE.json]
                           [--plot FILE.png]

Draws the run's own boundaries on a fixed held-out batch, adds one chunk start at a time where the sample
has none, and reports the discounted loss each saves (nats; > 0: that boundary helps), per class (a space
before a word, a word's first byte, inside a word, other), with standard errors; and the standard deviation
of the estimator's return on the same batch, the noise each decision's credit carries in training (for any
strategy: the return a policy would meet on this model); and the main network's context: the batch's bits per
byte with one chunk per window minus with the run's own chunks (about zero: the main network adds the same
vector whatever it reads, and no placement can matter) (megatok/eval/policy_probe.py). Prints a table;
--out writes JSON. With ``--checkpoint all`` (every kept checkpoint) or a list of tags it also prints the
trend: the value of a start at a space before a word over its noise, and how often the run starts a chunk
there, against the checkpoint's training bytes (``--plot`` draws it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory of a byte model (model.kind unet)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag (default: latest); 'all' for every kept "
                    "checkpoint, or a comma-separated list of tags: the trend against training bytes")
    ap.add_argument("--gamma", type=float, default=0.99, help="discount of the future losses saved")
    ap.add_argument("--rounds", type=int, default=8, help="added boundaries per sequence and class")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the run's data.seq_len")
    ap.add_argument("--data", default=None, help="shard directory (val split) or text files; default: the run's data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here (several checkpoints: "
                    "{'trend': rows, 'checkpoints': results})")
    ap.add_argument("--plot", type=Path, default=None, help="several checkpoints: the trend plot (PNG) here")
    args = ap.parse_args(argv)
    if not 0 <= args.gamma <= 1:
        ap.error("--gamma must be in [0, 1]")
    if args.rounds < 1 or args.batch_size < 2:
        ap.error("--rounds must be at least 1 and --batch-size at least 2")
    from megatok.eval.policy_probe import probe_run

    return probe_run(args.run, args.checkpoint, data=args.data, batch_size=args.batch_size, seq_len=args.seq_len,
                     gamma=args.gamma, rounds=args.rounds, seed=args.seed, out=args.out, plot=args.plot)


if __name__ == "__main__":
    sys.exit(main())
