"""How big is a config: parameters per component, FLOPs per byte, training FLOPs, memory per GPU,
checkpoint size on disk.

    megatok-model-size --config configs/1b.json [--gpus 8] [--nodes 1] [--json] [--rate 0.2] [--set KEY=VALUE ...]
    megatok-model-size --config configs/{100m,350m,1b,3b,7b,13b}.json     # one summary row per config
    megatok-model-size --run runs/1b [--checkpoint step00001000]           # a run: also its checkpoint, measured

Parameters are counted by formula and checked against the real model built on the meta device (no
memory, so 13B takes a second); the command fails if they differ. FLOPs per byte count byte-rate
layers at every byte and main layers at the chunk rate (``--rate``, default boundary.target_rate). A
BPE token-model config (model.kind "bpe", e.g. configs/bpe/*.json) is sized the same way, per byte at
``--rate`` tokens per byte (default 1 / model.bytes_per_token); its tokenizer is not read.
Memory is per GPU for DeepSpeed ZeRO 0-3 with and without CPU offload, for gpus x nodes data-parallel
ranks, plus the activations of one micro-batch. A checkpoint's size on disk is estimated per ZeRO stage
(weights in the working dtype, AdamW's fp32 states, the file each rank writes) and for the exports;
``--run`` sizes a run directory's config for the ranks that wrote its checkpoint and adds the measured
size of its latest checkpoint (or ``--checkpoint``). Formulas: megatok/flops.py and megatok/sizing.py.
"""

from __future__ import annotations

import argparse
import sys

from megatok import size_report, sizing
from megatok.cli import command_parser


def main(argv=None) -> int:
    ap = command_parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", nargs="+", help="one config (full report) or several (summary table)")
    which.add_argument("--run", metavar="RUN_DIR", help="a run directory: its config at the world size of its "
                                                        "checkpoints, and its latest checkpoint measured on disk")
    ap.add_argument("--checkpoint", "--tag", dest="tag", default=None,
                    help="with --run: the checkpoint tag to measure (default: the latest)")
    ap.add_argument("--gpus", type=sizing.positive(int), default=8, help="GPUs (ranks) per node (default 8)")
    ap.add_argument("--nodes", type=sizing.positive(int), default=1, help="nodes (default 1)")
    ap.add_argument("--rate", type=sizing.positive(float, most=1), default=None, help="chunks per byte (default boundary.target_rate); for a bpe config tokens per byte "
                         "(default 1 / model.bytes_per_token)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    if args.tag and not args.run:
        ap.error("--checkpoint goes with --run")
    if args.run and args.overrides:
        ap.error("--set does not go with --run (a run is sized as it was configured)")
    sizing.quiet_deepspeed_import()
    if args.run:
        return size_report.print_run_size(args.run, tag=args.tag, rate=args.rate, as_json=args.json)
    return size_report.print_config_sizes(args.config, args.overrides, gpus=args.gpus, nodes=args.nodes,
                                          rate=args.rate, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
