"""megatok-match-bpe: the command line of megatok.bpe_config (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok import bpe_config, sizing
from megatok.config import ConfigError
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=bpe_config.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the megatok (unet) config to match")
    tok = ap.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="megatok-train-bpe output directory or its tokenizer.model")
    tok.add_argument("--vocab-size", type=int, help="tokenizer pieces (without --tokenizer)")
    ap.add_argument("--bytes-per-token", type=float, help="expected bytes per token of the training data")
    ap.add_argument("--tokenizer-path", default="data/bpe/tokenizer.model",
                    help="model.tokenizer to write with --vocab-size (default data/bpe/tokenizer.model)")
    ap.add_argument("--rate", type=sizing.positive(float, most=1), default=None,
                    help="chunks per byte of the unet (default its target_rate)")
    ap.add_argument("--out", required=True, help="config file to write")
    ap.add_argument("--run-dir", default=None, help="train.run_dir of the BPE run (default: the source's + '-bpe')")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    if args.tokenizer and args.tokenizer_path != ap.get_default("tokenizer_path"):
        print("error: --tokenizer-path is for --vocab-size; --tokenizer already names the model", file=sys.stderr)
        return 2
    sizing.quiet_deepspeed_import()
    try:
        bpe_config.write_matched(args.config, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                 bytes_per_token=args.bytes_per_token, tokenizer_path=args.tokenizer_path,
                                 rate=args.rate, run_dir=args.run_dir, overrides=args.overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
