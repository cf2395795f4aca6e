"""Pretrain megatok.

    deepspeed --num_gpus 2 launch/pretrain.py --config configs/tiny.json [--set train.max_steps=20 ...]
    python launch/pretrain.py --config configs/tiny.json          # one process

The config is loaded and checked (and the data located) before any process group starts: a mistake
costs one line on stderr and exit code 2, never a half-started job.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatok.config import ConfigError, load_config  # noqa: E402
from megatok.data.documents import DataError  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON config (may 'extends' another)")
    p.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override config values by dotted key, e.g. train.max_steps=20 data.shards=data/shards")
    p.add_argument("--resume", default="auto",
                   help="'auto' (latest checkpoint in the run directory, if any), 'none', or a checkpoint tag")
    p.add_argument("--dry-run", nargs="?", type=int, const=0, default=None, metavar="RANKS",
                   help="resolve the config for RANKS ranks (default $WORLD_SIZE, else 8), build the model on the "
                        "meta device, print its size table and the DeepSpeed config, exit (no data, no process group)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p.parse_args(argv)


def check_data(cfg) -> None:
    from megatok.data.stream import check_readers, resolve_shards

    train = resolve_shards(cfg.data.shards, "train")
    resolve_shards(cfg.data.val_shards or cfg.data.shards, "val")
    check_readers(len(train), int(os.environ.get("WORLD_SIZE", "1")), max(1, cfg.data.num_workers))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run is not None:
        from megatok.flops import dry_run

        return dry_run(args.config, args.overrides, args.dry_run or None)
    try:
        cfg = load_config(args.config, args.overrides)
        check_data(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from megatok.train.loop import train

    train(cfg, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
