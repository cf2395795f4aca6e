"""Evaluate a run's latest checkpoint (or an export) on text: prints one JSON object.

    megatok-evaluate --run runs/tiny --data held_out.jsonl [more files or a shard directory]
    megatok-evaluate --run exports/tiny --data held_out.jsonl      # a megatok-export directory ("checkpoint": null)

Inputs are what build_shards reads (.txt, .txt.gz, .jsonl, .jsonl.gz, directories of them), or a
build_shards output directory (its validation split). Figures: bpb (corpus: total NLL over total
bytes, and the per-document mean), bytes_per_chunk, boundary_rate, whitespace_boundary_fraction,
and the same per "lang" and "domain" when the documents carry them. Boundaries are sampled with a
fixed seed by default (``--boundary sample``) or chosen deterministically (threshold: p > 0.5); the
output says which under "boundary_rule".
"""

from __future__ import annotations

import argparse
import json
import sys


from megatok import sizing
from megatok.config import ConfigError
from megatok.data.documents import DataError
from megatok.eval.evaluate import evaluate_run
from megatok.cli import add_device, command_parser, device_or_default


def main(argv=None) -> int:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory (holds config.json and checkpoints/) or an export "
                                                 "(megatok-export)")
    ap.add_argument("--data", required=True, nargs="+", help="files, directories, or a shard directory")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag of a run (default: latest)")
    ap.add_argument("--boundary", choices=["sample", "threshold"], default="sample")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed for --boundary sample")
    ap.add_argument("--seq-len", type=sizing.positive(int), default=None,
                    help="window length (default: the run's data.seq_len)")
    ap.add_argument("--batch-size", type=sizing.positive(int), default=8)
    add_device(ap)
    ap.add_argument("--max-bytes", type=float, default=None,
                    help="stop after the document that brings the total to this many bytes")
    args = ap.parse_args(argv)
    args.device = device_or_default(args.device)
    # stdout carries the JSON result only: DeepSpeed's loggers print to whatever stdout is when it loads.
    result_out, sys.stdout = sys.stdout, sys.stderr
    try:
        out = evaluate_run(args.run, args.data, checkpoint=args.checkpoint, boundary=args.boundary, seed=args.seed,
                           seq_len=args.seq_len, batch_size=args.batch_size, device=args.device,
                           max_bytes=args.max_bytes)
    except (DataError, FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout = result_out
    print(json.dumps(out, indent=2, allow_nan=False))  # NaN (0 / 0): null
    return 0


if __name__ == "__main__":
    sys.exit(main())
