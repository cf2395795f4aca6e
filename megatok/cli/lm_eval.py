"""Run lm-evaluation-harness tasks on a run or an export (either model kind).

    megatok-lm-eval --run runs/my-run --tasks lambada_openai,hellaswag --out results.json
    megatok-lm-eval --run exports/my-model --tasks my_task --include-path tasks/ --limit 100

Prints the harness's results table; --out writes its results as JSON. Tasks are the harness's (its
datasets come from the Hugging Face hub, or from local files: docs/api.md) or YAML files under
--include-path. The model is megatok.load's (boundary rule, seed, dtype, device); how each request type
is answered: megatok/eval/harness.py.
"""

from __future__ import annotations

import argparse
import sys

from megatok import sizing
from megatok.cli import add_device, command_parser, device_or_default


def main(argv=None) -> int:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", "--model", dest="model", required=True, help="run directory or export directory")
    ap.add_argument("--tasks", required=True, help="comma-separated task (or group) names")
    ap.add_argument("--include-path", default=None, help="a directory of task YAML files")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag of a run (default: latest)")
    add_device(ap)
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--boundary", default="threshold", choices=["threshold", "sample"],
                    help="byte model: chunk boundaries p > 0.5 (default) or sampled with --seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=sizing.positive(int), default=8, help="windows per forward; prompts decoded together")
    ap.add_argument("--num-fewshot", type=int, default=None)
    ap.add_argument("--limit", type=sizing.positive(float), default=None, help="documents per task (a fraction if < 1)")
    ap.add_argument("--out", "--output", dest="output", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.device = device_or_default(args.device)

    sizing.quiet_deepspeed_import()
    from megatok.eval.harness import run_tasks

    return run_tasks(args.model, [t.strip() for t in args.tasks.split(",") if t.strip()],
                     include_path=args.include_path, checkpoint=args.checkpoint, device=args.device, dtype=args.dtype,
                     boundary=args.boundary, seed=args.seed, batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                     limit=args.limit, output=args.output)


if __name__ == "__main__":
    sys.exit(main())
