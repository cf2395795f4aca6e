"""Export a run's checkpoint as safetensors + config (no DeepSpeed needed to use it).

    megatok-export --run runs/tiny --out exports/tiny [--dtype fp32|bf16] [--checkpoint step00000300]

Works from checkpoints of any ZeRO stage and world size. Load it with
``megatok.run.export.load_exported("exports/tiny")``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory")
    ap.add_argument("--out", required=True, help="export directory (an earlier export there is replaced; anything else is refused)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag (default: latest)")
    args = ap.parse_args(argv)
    from megatok.config import ConfigError
    from megatok.run.export import export

    try:
        out = export(args.run, args.out, dtype=args.dtype, tag=args.checkpoint)
    except (FileNotFoundError, FileExistsError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.run} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
