"""What ``megatok-model-size`` and ``launch/pretrain.py --dry-run`` print of megatok.sizing's size report:
the report as text or JSON, one summary row per config (docs/scaling.md's tables), a run's measured
checkpoint against the estimate, and the dry run (the config resolved, the model built on the meta
device, the DeepSpeed config the trainer would use)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from megatok.config import ConfigError, load_config, warnings_for
from megatok.data.encoding import encoding_for
from megatok.dsconfig import deepspeed_config
from megatok.flops import build_meta_model
from megatok.sizing import GIB, positive, quiet_deepspeed_import, size_report


def _h(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def format_report(r: dict[str, Any]) -> str:
    p, f, mem = r["params"], r["flops_per_byte"], r["memory"]
    w = r["world"]
    bpe = r.get("kind") == "bpe"
    unit = r.get("seq_unit", "bytes")
    lines = [f"parameters (instantiated on the meta device: {r['params_instantiated']:,})",
             "| component | params | share |", "|---|---:|---:|"]
    for k, v in p.items():
        share = 100 * v / p["total"]
        lines.append(f"| {k} | {v:,} | {'<0.1' if 0 < share < 0.05 else f'{share:.1f}'}% |")
    at = (f"{r['rate']:g} tokens per byte ({1 / r['rate']:.3g} bytes/token)" if bpe else f"rate {r['rate']:g}")
    lines += ["", f"FLOPs per byte at {at} (seq_len {r['seq_len']} {unit}; forward terms, training = 3 x forward)",
              "| term | FLOPs/byte |", "|---|---:|"]
    for k, v in f.items():
        lines.append(f"| {k} | {_h(v)} |")
    b = r["batch"]
    seq = (f"{r['seq_len']} tokens x {1 / r['rate']:.3g} bytes/token" if bpe else f"{r['seq_len']} bytes")
    lines += ["", f"training: {b['max_steps']:,} steps x {b['global']} sequences x {seq} = "
              f"{_h(r['training_bytes'])} bytes -> {r['training_flops']:.3e} FLOPs "
              f"({w['nodes']} node(s) x {w['gpus_per_node']} GPU(s), micro {b['micro']}, accum {b['grad_accum']})",
              "", f"memory per GPU for model states ({'bf16 + fp32 master' if mem['bf16'] else 'fp32'}, "
              f"{w['ranks']} data-parallel ranks), GiB",
              "| ZeRO | offload | GPU | host RAM per rank |", "|---:|---|---:|---:|"]
    for row in mem["stages"]:
        lines.append(f"| {row['stage']} | {row['offload']} | {row['gpu_bytes'] / GIB:.2f} | {row['host_bytes'] / GIB:.2f} |")
    a, c = mem["activations"], mem["configured"]
    lines += ["", f"activations per micro-batch ({b['micro']} x {r['seq_len']} {unit}): "
              f"{a['no_checkpointing']['total'] / GIB:.2f} GiB without checkpointing, "
              f"{a['checkpointing']['total'] / GIB:.2f} GiB with"
              + (f" (document masks {a['checkpointing']['masks'] / GIB:.2f} GiB included)"
                 if a["checkpointing"]["masks"] else ""),
              f"as configured (ZeRO-{c['stage']}): model states {c['model_states_gpu_bytes'] / GIB:.2f} GiB + "
              f"activations {c['activation_bytes'] / GIB:.2f} GiB = {c['total_gpu_bytes'] / GIB:.2f} GiB per GPU"
              + (f", {c['host_bytes'] / GIB:.2f} GiB host RAM per rank" if c["host_bytes"] else ""),
              (f"at start-up the model is built already partitioned (ZeRO-3, train.zero_init): at most "
               f"{max(c['init_gpu_bytes'], c['init_host_bytes']) / GIB:.2f} GiB per rank on the "
               f"{'host' if c['init_host_bytes'] else 'GPU'}, never the whole model" if c.get("init_partitioned") else
               f"at start-up each rank builds the whole model in fp32 on its GPU ({c['init_gpu_bytes'] / GIB:.2f} GiB), "
               f"then casts it to the working precision")]
    if "at_most" in mem:
        m = mem["at_most"]
        lines.append(f"at most, with the main network at {m['rate']:g} chunks per byte "
                     + (f"(model.chunk_capacity {m['capacity']:g}, rounded up)" if m["capacity"] is not None else
                        "(no model.chunk_capacity: a policy that starts a chunk at every byte; set one to bound it)")
                     + f": activations {m['activation_bytes'] / GIB:.2f} GiB, {m['total_gpu_bytes'] / GIB:.2f} GiB "
                       f"per GPU")
    lines += ["", *format_checkpoint(r)]
    return "\n".join(lines)


def format_checkpoint(r: dict[str, Any]) -> list[str]:
    ck, w = r["checkpoint"], r["world"]
    dtype = "bf16" if ck["bf16"] else "fp32"
    lines = [f"checkpoint on disk (AdamW, {dtype} weights{' + fp32 master' if ck['bf16'] else ''}, "
             f"{w['ranks']} ranks), GiB",
             f"| ZeRO | weights ({dtype}) | optimizer states (fp32) | optimizer file per rank | checkpoint |",
             "|---:|---:|---:|---:|---:|"]
    for row in ck["stages"]:
        per_rank = f"{row['optimizer_per_rank'] / GIB:.2f}" if row["stage"] else "- (in the weights file)"
        weights = f"{row['weights'] / GIB:.2f}" if row["stage"] < 3 else "- (the fp32 master)"
        lines.append(f"| {row['stage']} | {weights} | {row['optimizer'] / GIB:.2f} | {per_rank} | "
                     f"{row['total'] / GIB:.2f} |")
    c, one = r["memory"]["configured"]["stage"], ck["configured"]["total"]
    lines.append(f"as configured (ZeRO-{c}): {one / GIB:.2f} GiB per checkpoint; the run keeps the newest "
                 f"train.keep_checkpoints = {ck['keep_checkpoints']}: {ck['keep_checkpoints'] * one / GIB:.2f} GiB"
                 + (f", plus every train.keep_every = {ck['keep_every']} steps for good" if ck["keep_every"] else ""))
    lines.append(f"exported weights (megatok-export): {ck['export']['fp32'] / GIB:.2f} GiB in fp32, "
                 f"{ck['export']['bf16'] / GIB:.2f} GiB in bf16")
    return lines


def report_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2)


def summary_table(reports: list[dict[str, Any]]) -> str:
    """One markdown row per size report (``report["config"]``: its config's path), as megatok-model-size
    prints for several configs and docs/scaling.md holds."""
    gib = GIB
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


def _file_size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def print_config_sizes(paths: list[str], overrides: list[str] = (), *, gpus: int = 8, nodes: int = 1,
                       rate: float | None = None, as_json: bool = False) -> int:
    """megatok-model-size --config: the report of one config, or a summary row per config, printed; 2 with
    one error line for a config that does not load, 1 when the formula's parameter count is not the
    model's."""
    reports = []
    for path in paths:
        try:
            cfg = load_config(path, list(overrides), world_size=gpus * nodes,
                              world_from=f"--gpus {gpus} x --nodes {nodes}; give the ranks you will train on")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        report = size_report(cfg, gpus=gpus, nodes=nodes, rate=rate)
        if report["params_instantiated"] != report["params"]["total"]:
            print(f"error: {path}: formula gives {report['params']['total']:,} parameters but the model has "
                  f"{report['params_instantiated']:,}: megatok/flops.py is out of date", file=sys.stderr)
            return 1
        report["config"] = path
        reports.append(report)
    if as_json:
        print(report_json(reports[0] if len(reports) == 1 else reports))
    elif len(reports) == 1:
        print(format_report(reports[0]))
    else:
        print(summary_table(reports))
    return 0


def print_run_size(run: str, *, tag: str | None = None, rate: float | None = None, as_json: bool = False) -> int:
    """megatok-model-size --run: the report for a run directory's config, at the world size of the
    checkpoint measured (the latest, or ``tag``), with that checkpoint's size on disk; 2 with one error
    line for a run that cannot be read."""
    from megatok.run.checkpoints import disk_usage, read_meta
    from megatok.run.reader import checkpoint_to_read, run_config

    try:
        cfg = run_config(run)
        tag = checkpoint_to_read(run, tag) if (tag or Path(run, "checkpoints").is_dir()) else None
        used = disk_usage(run, tag) if tag else None
        world = int(read_meta(run, tag)["world_size"]) if tag else None
    except (ConfigError, OSError, KeyError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t = cfg.train
    world = world or t.global_batch_size // (t.micro_batch_size * t.grad_accum)
    report = size_report(cfg, gpus=world, nodes=1, rate=rate)
    report["config"] = str(Path(run) / "config.json")
    report["measured_checkpoint"] = used
    if as_json:
        print(report_json(report))
        return 0
    print(format_report(report))
    if used is None:
        print(f"measured: {run} has no checkpoint yet")
        return 0
    est = report["checkpoint"]["configured"]
    stage = report["memory"]["configured"]["stage"]
    print(f"measured: {used['path']}: {_file_size(used['total'])} in {used['files']} files: model states "
          f"{_file_size(used['model_states'])}, optimizer states {_file_size(used['optimizer'])} in "
          f"{used['optimizer_files']} file(s) (largest {_file_size(used['largest_optimizer_file'])}), other "
          f"{_file_size(used['other'])}; estimate for ZeRO-{stage} on {world} rank(s): {_file_size(est['total'])}")
    return 0


def dry_run(config: str, overrides: list[str] = (), world: int | None = None, out=None) -> int:
    """``launch/pretrain.py --dry-run``: resolve the config for ``world`` ranks (default $WORLD_SIZE,
    else 8: one node), build the model on the meta device, print the size table and the DeepSpeed
    config the trainer would hand to deepspeed.initialize. No data, no process group. Returns the
    exit code (2 on a config mistake, as the trainer)."""
    import os

    out = out or sys.stdout
    quiet_deepspeed_import()
    world_from = f"--dry-run {world}"
    if world is None:
        world_from = "$WORLD_SIZE" if "WORLD_SIZE" in os.environ else "--dry-run's default 8; --dry-run N for N ranks"
        try:
            world = positive(int)(os.environ.get("WORLD_SIZE", "8"))
        except Exception as e:  # noqa: BLE001 - argparse's error type
            print(f"error: WORLD_SIZE: {e}", file=sys.stderr)
            return 2
    try:
        cfg = load_config(config, list(overrides), world_size=world, world_from=world_from)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in warnings_for(cfg):
        print(f"warning: {line}", file=sys.stderr)
    if cfg.model.kind == "bpe" and cfg.model.tokenizer:  # a few MB, read as the trainer will: it must fit
        if not Path(cfg.model.tokenizer).exists():
            print(f"note: model.tokenizer {cfg.model.tokenizer} is not on this machine; the trainer checks it "
                  f"against model.vocab_size at launch", file=sys.stderr)
        else:
            try:
                encoding_for(cfg)
            except ConfigError as e:
                print(f"error: {config}: {e}", file=sys.stderr)
                return 2
    model = build_meta_model(cfg)
    report = size_report(cfg, gpus=world, nodes=1, model=model)
    print(f"dry run: {config}, {world} rank(s); model built on the meta device, no data read, no process group",
          file=out)
    print(format_report(report), file=out)
    print(f"\nresolved DeepSpeed config ({world} ranks):", file=out)
    print(json.dumps(deepspeed_config(cfg, world), indent=2), file=out)
    return 0
