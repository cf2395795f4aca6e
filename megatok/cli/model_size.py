"""How big is a config: parameters per component, FLOPs per byte, training FLOPs, memory per GPU,
checkpoint size on disk.

    megatok-model-size --config configs/1b.json [--gpus 8] [--nodes 1] [--json] [--rate 0.2] [--set KEY=VALUE ...]
    megatok-model-size --config configs/{100m,350m,1b,3b,7b,13b}.json     # one summary row per config
    megatok-model-size --run runs/1b [--tag step00001000]                  # a run: also its checkpoint, measured

Parameters are counted by formula and checked against the real model built on the meta device (no
memory, so 13B takes a second); the command fails if they differ. FLOPs per byte count byte-rate
layers at every byte and main layers at the chunk rate (``--rate``, default boundary.target_rate). A
BPE token-model config (model.kind "bpe", e.g. configs/bpe/*.json) is sized the same way, per byte at
``--rate`` tokens per byte (default 1 / model.bytes_per_token); its tokenizer is not read.
Memory is per GPU for DeepSpeed ZeRO 0-3 with and without CPU offload, for gpus x nodes data-parallel
ranks, plus the activations of one micro-batch. A checkpoint's size on disk is estimated per ZeRO stage
(weights in the working dtype, AdamW's fp32 states, the file each rank writes) and for the exports;
``--run`` sizes a run directory's config for the ranks that wrote its checkpoint and adds the measured
size of its latest checkpoint (or ``--tag``). Formulas: megatok/flops.py and megatok/sizing.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatok import sizing
from megatok.config import ConfigError, load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", nargs="+", help="one config (full report) or several (summary table)")
    which.add_argument("--run", metavar="RUN_DIR", help="a run directory: its config at the world size of its "
                                                        "checkpoints, and its latest checkpoint measured on disk")
    ap.add_argument("--tag", default=None, help="with --run: the checkpoint to measure (default: the latest)")
    ap.add_argument("--gpus", type=sizing.positive(int), default=8, help="GPUs (ranks) per node (default 8)")
    ap.add_argument("--nodes", type=sizing.positive(int), default=1, help="nodes (default 1)")
    ap.add_argument("--rate", type=sizing.positive(float, most=1), default=None, help="chunks per byte (default boundary.target_rate); for a bpe config tokens per byte "
                         "(default 1 / model.bytes_per_token)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    if args.tag and not args.run:
        ap.error("--tag goes with --run")
    if args.run and args.overrides:
        ap.error("--set does not go with --run (a run is sized as it was configured)")
    sizing.quiet_deepspeed_import()
    if args.run:
        return _run_report(args)
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


def _run_report(args) -> int:
    """The report for a run directory's config, at the world size of the checkpoint measured."""
    from megatok.run.checkpoints import disk_usage, read_meta
    from megatok.run.reader import checkpoint_to_read, run_config

    try:
        cfg = run_config(args.run)
        tag = checkpoint_to_read(args.run, args.tag) if (args.tag or Path(args.run, "checkpoints").is_dir()) else None
        used = disk_usage(args.run, tag) if tag else None
        world = int(read_meta(args.run, tag)["world_size"]) if tag else None
    except (ConfigError, OSError, KeyError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg.train
    world = world or t.global_batch_size // (t.micro_batch_size * t.grad_accum)
    report = sizing.size_report(cfg, gpus=world, nodes=1, rate=args.rate)
    report["config"] = str(Path(args.run) / "config.json")
    report["measured_checkpoint"] = used
    if args.json:
        print(sizing.report_json(report))
        return 0
    print(sizing.format_report(report))
    if used is None:
        print(f"measured: {args.run} has no checkpoint yet")
        return 0
    est = report["checkpoint"]["configured"]
    stage = report["memory"]["configured"]["stage"]
    print(f"measured: {used['path']}: {_size(used['total'])} in {used['files']} files: model states "
          f"{_size(used['model_states'])}, optimizer states {_size(used['optimizer'])} in {used['optimizer_files']} "
          f"file(s) (largest {_size(used['largest_optimizer_file'])}), other {_size(used['other'])}; "
          f"estimate for ZeRO-{stage} on {world} rank(s): {_size(est['total'])}")
    return 0


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def summary(reports) -> str:
    gib = sizing.GIB
    lines = ["| config | params | main share | FLOPs/byte (train) | byte-rate share | ZeRO | micro x accum | "
             "GPU GiB (states + act.) | checkpoint GiB | training bytes | training FLOPs |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
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
                     f"{r['checkpoint']['configured']['total'] / gib:,.1f} | "
                     f"{r['training_bytes'] / 1e9:,.0f}G | {r['training_flops']:.2e} |")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
