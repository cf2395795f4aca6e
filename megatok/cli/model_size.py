"""How big is a config: parameters per component, FLOPs per byte, training FLOPs, memory per GPU.

    megatok-model-size --config configs/1b.json [--gpus 8] [--nodes 1] [--json] [--rate 0.2] [--set KEY=VALUE ...]
    megatok-model-size --config configs/{100m,350m,1b,3b,7b,13b}.json     # one summary row per config

Parameters are counted by formula and checked against the real model built on the meta device (no
memory, so 13B takes a second); the command fails if they differ. FLOPs per byte count byte-rate
layers at every byte and main layers at the chunk rate (``--rate``, default boundary.target_rate). A
BPE token-model config (model.kind "bpe", e.g. configs/bpe/*.json) is sized the same way, per byte at
``--rate`` tokens per byte (default 1 / model.bytes_per_token); its tokenizer is not read.
Memory is per GPU for DeepSpeed ZeRO 0-3 with and without CPU offload, for gpus x nodes data-parallel
ranks, plus the activations of one micro-batch. Formulas: megatok/flops.py and megatok/sizing.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatok import sizing
from megatok.config import ConfigError, load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, nargs="+", help="one config (full report) or several (summary table)")
    ap.add_argument("--gpus", type=sizing.positive(int), default=8, help="GPUs (ranks) per node (default 8)")
    ap.add_argument("--nodes", type=sizing.positive(int), default=1, help="nodes (default 1)")
    ap.add_argument("--rate", type=sizing.positive(float, most=1), default=None, help="chunks per byte (default boundary.target_rate); for a bpe config tokens per byte "
                         "(default 1 / model.bytes_per_token)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    sizing.quiet_deepspeed_import()
    reports = []
    for path in args.config:
        try:
            cfg = load_config(path, args.overrides, world_size=args.gpus * args.nodes)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        report = sizing.size_report(cfg, gpus=args.gpus, nodes=args.nodes, rate=args.rate)
        if report["params_instantiated"] != report["params"]["total"]:
            print(f"error: {path}: formula gives {report['params']['total']:,} parameters but the model has "
                  f"{report['params_instantiated']:,}: megatok/flops.py is out of date", file=sys.stderr)
            return 1
        report["config"] = path
        reports.append(report)
    if args.json:
        print(sizing.report_json(reports[0] if len(reports) == 1 else reports))
    elif len(reports) == 1:
        print(sizing.format_report(reports[0]))
    else:
        print(summary(reports))
    return 0


def summary(reports) -> str:
    gib = sizing.GIB
    lines = ["| config | params | main share | FLOPs/byte (train) | byte-rate share | ZeRO | micro x accum | "
             "GPU GiB (states + act.) | training bytes | training FLOPs |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in reports:
        p, f, c, b = r["params"], r["flops_per_byte"], r["memory"]["configured"], r["batch"]
        # the unet's heads run at byte rate; a bpe model has nothing at byte rate
        heads = 0 if r.get("kind") == "bpe" else f["heads"]
        byte_share = (f["byte_matmul"] + f["byte_attention"] + heads) / f["forward"]
        name = Path(r["config"])
        name = f"{name.parent.name}/{name.name}" if name.parent.name not in ("configs", "") else name.name
        lines.append(f"| {name} | {p['total'] / 1e6:,.0f}M | {100 * p['main'] / p['total']:.0f}% | "
                     f"{f['training'] / 1e9:.2f}G | {100 * byte_share:.0f}% | {c['stage']} | "
                     f"{b['micro']} x {b['grad_accum']} | {c['model_states_gpu_bytes'] / gib:.1f} + "
                     f"{c['activation_bytes'] / gib:.1f} = {c['total_gpu_bytes'] / gib:.1f} | "
                     f"{r['training_bytes'] / 1e9:,.0f}G | {r['training_flops']:.2e} |")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
