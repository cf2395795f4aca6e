"""The value of one added boundary, by byte class, at any checkpoint of a byte model.

    megatok-boundary-value --run runs/x [--checkpoint step300] [--gamma 0.99] [--rounds 8]
                           [--batch-size 16] [--seq-len N] [--data DIR_OR_FILES] [--seed 0] [--out FILE.json]

Draws the run's own boundaries on a fixed held-out batch, adds one chunk start at a time where the sample
has none, and reports the discounted loss each saves (nats; > 0: that boundary helps), per class (a space
before a word, a word's first byte, inside a word, other), with standard errors; and the standard deviation
of the estimator's return on the same batch, the noise each decision's credit carries in training (for any
strategy: the return a policy would meet on this model) (megatok/eval/policy_probe.py). Prints a table;
--out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory of a byte model (model.kind unet)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag (default: latest)")
    ap.add_argument("--gamma", type=float, default=0.99, help="discount of the future losses saved")
    ap.add_argument("--rounds", type=int, default=8, help="added boundaries per sequence and class")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the run's data.seq_len")
    ap.add_argument("--data", default=None, help="shard directory (val split) or text files; default: the run's data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if not 0 <= args.gamma <= 1:
        ap.error("--gamma must be in [0, 1]")
    if args.rounds < 1 or args.batch_size < 2:
        ap.error("--rounds must be at least 1 and --batch-size at least 2")
    import torch

    from megatok.eval.policy_probe import boundary_values, fixed_batch, format_table
    from megatok.run.reader import load_model

    try:
        model, cfg, tag = load_model(args.run, args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.model.kind != "unet":
        print(f"error: {args.run}: a {cfg.model.kind} token model has no boundaries to probe", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokens = fixed_batch(cfg, args.data, args.batch_size, args.seq_len or cfg.data.seq_len)
    result = {"run": str(args.run), "checkpoint": tag, "strategy": cfg.boundary.strategy,
              **boundary_values(model, tokens, gamma=args.gamma, rounds=args.rounds, seed=args.seed)}
    print(f"{args.run} ({tag}, {cfg.boundary.strategy}): one added boundary, discounted loss saved "
          f"(gamma {args.gamma}), {args.rounds} per sequence and class on {result['batch'][0]} x {result['batch'][1]} bytes")
    print(format_table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
