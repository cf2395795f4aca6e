"""Export a run's checkpoint as sharded safetensors + config (no DeepSpeed needed to use it).

    megatok-export --run runs/tiny --out exports/tiny [--dtype fp32|bf16|fp16] [--checkpoint step00000300]
                   [--max-shard-size 5GB]

Works from checkpoints of any ZeRO stage and world size; the weights are merged and written one tensor
at a time. A BPE token model is written as a transformers Llama checkpoint
(``transformers.AutoModelForCausalLM.from_pretrained("exports/bpe")``, its tokenizer with AutoTokenizer);
either kind loads with ``megatok.load("exports/tiny")``. Layout: docs/api.md.
"""

from __future__ import annotations

import argparse
import sys
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory")
    ap.add_argument("--out", required=True, help="export directory (an earlier export there is replaced; anything else is refused)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag (default: latest)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB; a size or bytes)")
    args = ap.parse_args(argv)
    from megatok.config import ConfigError
    from megatok.run.export import export, shard_size

    try:
        out = export(args.run, args.out, dtype=args.dtype, tag=args.checkpoint,
                     max_shard_size=shard_size(args.max_shard_size))
    except (FileNotFoundError, FileExistsError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.run} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
