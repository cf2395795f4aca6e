"""A scaling study: one run per (size, boundary strategy), all at the same number of training bytes.

    megatok-sweep --sizes 100m,350m,1b --strategies policy,fixed --bytes 2e9 --out sweeps/s1 \\
        [--set data.shards=/shared/shards ...] [--option bpe.model_path=data/bpe32k/tokenizer.model ...] \\
        [--strategies policy,bpe-lm --bpe-tokenizer runs/bpe32k | --bpe-vocab-size 32000 --bpe-bytes-per-token 4.2] \\
        [--gpus 8 --nodes 1] [--emit sbatch | --run-local [--nproc N]]
    megatok-sweep --out sweeps/s1 --collect          # table + loss-against-FLOPs plot

Writing (the default): for every size (``configs/<size>.json`` or a path) and strategy, a complete
config ``OUT/configs/<size>-<strategy>.json`` (no ``extends``: it is the record of the run) with
``train.max_steps = ceil(bytes / (global batch x seq_len))``, warmup capped at a tenth of the steps,
``train.run_dir = OUT/runs/<size>-<strategy>``, and the size's boundary section when the strategy is
the size's own (its tuned options), else just ``{strategy, target_rate}`` with that strategy's
defaults plus ``--option STRATEGY.KEY=VALUE``. Every config is validated for gpus x nodes ranks
(``--run-local``: for --nproc ranks) before anything runs; ``OUT/sweep.json`` lists the runs with
their parameters and FLOPs per byte. Strategies are checked against ``megatok.boundaries.available()``.

``bpe-lm`` is not a boundary strategy but the BPE token model (model.kind "bpe") matched to the size's
unet in training FLOPs per byte by megatok.flops.match_bpe (as megatok-match-bpe does; data.seq_len in
tokens covering the same bytes). It needs ``--bpe-tokenizer`` (a megatok-train-bpe output: pieces from
the tokenizer, bytes per token from its report.json) or ``--bpe-vocab-size`` and ``--bpe-bytes-per-token``
(then ``--bpe-tokenizer``, default data/bpe/tokenizer.model, is only the path written; it need not exist
yet). Its steps keep the bytes equal: bytes per step = global batch x seq_len tokens x bytes_per_token.
(The ``bpe`` strategy is different: megatok's unet with chunks at BPE token boundaries.)

``--emit sbatch`` prints (and writes to OUT/submit.sh) one ``sbatch`` line per run for
launch/slurm/pretrain.sbatch. ``--run-local`` runs them here one after another (``deepspeed
--num_gpus N`` for N > 1, else one process); a run whose final validation row exists is skipped, and
an interrupted one resumes from its checkpoint.

``--collect`` reads each run's metrics.jsonl: the last validation row (val_bpb, bytes per chunk,
boundary rule) and the realised boundary rate (mean of the training rows), and writes
``OUT/results.md`` (a markdown table) and ``OUT/loss_vs_flops.png``: validation bits per byte against
training FLOPs, one line per strategy through its sizes' final points, and each run's validation
curve. Training FLOPs are what each run logged, else FLOPs per byte x bytes seen (megatok.flops.flops_at). The runs
that have started also go through the compare tool (megatok-compare) into ``OUT/compare/``.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatok import flops, sizing
from megatok.boundaries import available
from megatok.bpe import tokenizer_facts
from megatok.config import CONFIGS, ConfigError, load_config
from megatok.data.documents import DataError
from megatok.metrics import read_metrics
from megatok.studies import StudyError, compare
from megatok.studies.launch import CHECKOUT, finished, local_command


@dataclass
class Settings:
    """What one megatok-sweep invocation does (its command line, megatok.cli.sweep, in these names)."""

    out: str  # the sweep directory
    sizes: str = "100m,350m,1b"  # comma-separated config names or paths
    strategies: str = "policy,fixed"  # comma-separated boundary strategies and BPE_LM
    bytes: float = 2e9  # training bytes per run
    gpus: int = 8  # GPUs per node of the generated jobs
    nodes: int = 1  # nodes per job
    overrides: list[str] = field(default_factory=list)  # --set items applied to every run
    option: list[str] = field(default_factory=list)  # STRATEGY.KEY=VALUE items for one strategy's runs
    bpe_tokenizer: str | None = None  # BPE_LM: megatok-train-bpe's output (directory or tokenizer.model)
    bpe_vocab_size: int | None = None  # BPE_LM: the tokenizer's pieces
    bpe_bytes_per_token: float | None = None  # BPE_LM: expected bytes per token (default: its report.json)
    emit: str | None = None  # "sbatch": print (and write OUT/submit.sh) the jobs' sbatch commands
    run_local: bool = False  # run the configs here, one after another
    nproc: int | None = None  # ranks for run_local (None: the GPUs here, else 1)
    collect: bool = False  # gather finished runs: OUT/results.md, OUT/loss_vs_flops.png


class SweepError(StudyError):
    pass


BPE_LM = "bpe-lm"  # the BPE token model, matched to each size's unet in FLOPs per byte
DEFAULT_BPE_TOKENIZER = "data/bpe/tokenizer.model"


def size_config(size: str) -> Path:
    p = Path(size)
    if p.suffix == ".json" and p.is_file():
        return p
    if p.suffix == ".json":
        raise SweepError(f"--sizes {size}: no such file")
    p = CONFIGS / f"{size}.json"
    if not p.is_file():
        raise SweepError(f"--sizes {size}: no configs/{size}.json")
    return p


def check_strategies(names: list[str]) -> None:
    for s in names:
        if s != BPE_LM and s not in available():
            raise SweepError(f"--strategies {s}: unknown strategy (available: {', '.join(available())}, "
                             f"and {BPE_LM}: the BPE token model)")


def parse_options(items: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        strategy, dot, opt = key.partition(".")
        if not sep or not dot:
            raise SweepError(f"--option {item}: expected STRATEGY.KEY=VALUE, e.g. bpe.model_path=data/bpe32k/tokenizer.model")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault(strategy, {})[opt] = parsed
    return out


def bpe_facts(tokenizer: str | None, vocab_size: int | None, bytes_per_token: float | None) -> dict:
    """model.tokenizer, pieces and bytes per token for the bpe-lm runs, from the tokenizer (and its
    report.json) or given directly."""
    if vocab_size is not None and bytes_per_token is not None:
        return {"tokenizer": tokenizer or DEFAULT_BPE_TOKENIZER, "vocab_size": vocab_size,
                "bytes_per_token": bytes_per_token}
    if tokenizer is None:
        raise SweepError(f"--strategies {BPE_LM} needs --bpe-tokenizer (a megatok-train-bpe output), or "
                         "--bpe-vocab-size and --bpe-bytes-per-token")
    model, pieces, bpt = tokenizer_facts(tokenizer)
    bpt = bytes_per_token if bytes_per_token is not None else bpt
    if bpt is None:
        raise SweepError(f"--bpe-tokenizer {tokenizer}: no report.json with bytes per token; "
                         "give --bpe-bytes-per-token")
    return {"tokenizer": model, "vocab_size": vocab_size or pieces, "bytes_per_token": bpt}


def run_config(size: str, strategy: str, n_bytes: float, out: Path, world: int, overrides: list[str],
               options: dict[str, dict], bpe: dict | None = None) -> dict:
    """The complete config dict of one run (``bpe``: :func:`bpe_facts`, for the bpe-lm strategy)."""
    base = load_config(size_config(size), overrides, world_size=world)
    raw = base.to_dict()
    seq_bytes = base.data.seq_len
    if strategy == BPE_LM:
        if base.model.kind != "unet":
            raise SweepError(f"--sizes {size}: {BPE_LM} is matched to a unet config, this one is model.kind "
                             f"'{base.model.kind}'")
        match = flops.match_bpe(base, **bpe)
        raw["model"].update(match["overrides"]["model"])
        raw["data"].update(match["overrides"]["data"])
        seq_bytes = raw["data"]["seq_len"] * bpe["bytes_per_token"]  # expected bytes per sequence
    elif strategy != base.boundary.strategy:
        raw["boundary"] = {"strategy": strategy, "target_rate": base.boundary.target_rate}
    if strategy != BPE_LM:
        raw["boundary"].update(options.get(strategy, {}))
    t = raw["train"]
    per_step = base.train.micro_batch_size * base.train.grad_accum * world * seq_bytes
    t["max_steps"] = max(1, math.ceil(n_bytes / per_step))
    t["warmup_steps"] = min(t["warmup_steps"], max(1, t["max_steps"] // 10))
    t["save_every"] = min(t["save_every"], t["max_steps"])
    t["global_batch_size"] = base.train.micro_batch_size * base.train.grad_accum * world
    t["grad_accum"] = None  # derived again for the world size the run is launched with
    t["run_dir"] = str(out / "runs" / f"{Path(size).stem}-{strategy}")
    raw["logging"]["wandb_group"] = raw["logging"].get("wandb_group") or f"sweep-{out.name}"
    raw["logging"]["wandb_tags"] = [*raw["logging"].get("wandb_tags", []), Path(size).stem, strategy]
    if raw["eval"]["every"] and raw["eval"]["every"] > t["max_steps"]:
        raw["eval"]["every"] = 0  # validation at the end only
    return raw


def write(settings: Settings) -> list[dict]:
    """Every run's config, validated for the sweep's world size before any is written, and OUT/sweep.json:
    the runs (name, config, run directory, steps, bytes, parameters, FLOPs)."""
    sizes = [s for s in settings.sizes.split(",") if s]
    strategies = [s for s in settings.strategies.split(",") if s]
    check_strategies(strategies)
    options = parse_options(settings.option)
    for strategy in options:
        if strategy not in strategies:
            raise SweepError(f"--option {strategy}.{next(iter(options[strategy]))}: {strategy} is not in --strategies "
                             f"({','.join(strategies)})")
    for item in settings.overrides:
        key = item.partition("=")[0]
        if key in ("train.max_steps", "train.run_dir"):
            raise SweepError(f"--set {key}: the sweep sets it (max_steps from --bytes, run_dir under --out)")
    bpe = (bpe_facts(settings.bpe_tokenizer, settings.bpe_vocab_size, settings.bpe_bytes_per_token)
           if BPE_LM in strategies else None)
    world = settings.nproc if settings.run_local else settings.gpus * settings.nodes
    out = Path(settings.out).resolve()
    runs, written = [], []  # written: (name, size, strategy, validated config)
    staging = Path(tempfile.mkdtemp(prefix="megatok-sweep-"))  # every config validates before any is written
    try:
        for size in sizes:
            for strategy in strategies:
                name = f"{Path(size).stem}-{strategy}"
                raw = run_config(size, strategy, settings.bytes, out, world, settings.overrides, options, bpe)
                (staging / f"{name}.json").write_text(json.dumps(raw, indent=2) + "\n")
                try:
                    cfg = load_config(staging / f"{name}.json", world_size=world)
                except ConfigError as e:
                    raise SweepError(str(e).replace(str(staging), str(out / "configs"))) from None
                written.append((name, size, strategy, cfg))
        (out / "configs").mkdir(parents=True, exist_ok=True)
        for name, *_ in written:
            shutil.move(staging / f"{name}.json", out / "configs" / f"{name}.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name, size, strategy, cfg in written:
        fpb = flops.flops_per_byte(cfg)
        runs.append({"name": name, "size": Path(size).stem, "strategy": strategy, "kind": cfg.model.kind,
                     "config": str(out / "configs" / f"{name}.json"),
                     "run_dir": cfg.train.run_dir, "max_steps": cfg.train.max_steps, "world": world,
                     "training_bytes": flops.training_bytes(cfg, world),
                     "params": flops.param_counts(cfg)["total"], "flops_per_byte": fpb["training"],
                     "training_flops": flops.training_flops(cfg, world)})
    (out / "sweep.json").write_text(json.dumps({"bytes": settings.bytes, "runs": runs}, indent=2) + "\n")
    print(f"sweep: {len(runs)} configs in {out / 'configs'} ({settings.bytes:.3g} training bytes each, "
          f"validated for {world} rank(s))")
    return runs


def sbatch_lines(runs: list[dict], nodes: int, gpus: int) -> list[str]:
    return [f"sbatch --nodes={nodes} --gpus-per-node={gpus} --job-name=megatok-{r['name']} launch/slurm/pretrain.sbatch "
            f"--config {shlex.quote(r['config'])}" for r in runs]


def run_local(runs: list[dict], nproc: int) -> int:
    if not (CHECKOUT / "launch/pretrain.py").is_file():
        print(f"error: --run-local: no launch/pretrain.py in {CHECKOUT}: it runs the trainer of a megatok checkout "
              f"(or submit the configs with --emit sbatch)", file=sys.stderr)
        return 2
    for i, run in enumerate(runs, 1):
        if finished(run):
            print(f"sweep: [{i}/{len(runs)}] {run['name']}: finished already, skipped", flush=True)
            continue
        cmd = local_command(run, nproc)
        print(f"sweep: [{i}/{len(runs)}] {run['name']}: {shlex.join(cmd)}", flush=True)
        rc = subprocess.run(cmd).returncode  # from here, where the configs' relative paths were checked
        if rc != 0:
            print(f"sweep: {run['name']} failed with exit code {rc}; rerun the same command to resume", file=sys.stderr)
            return rc
    return 0


# ----------------------------------------------------------------------------- collect

def collect(out: Path) -> list[dict]:
    if not (out / "sweep.json").is_file():
        raise SweepError(f"{out / 'sweep.json'}: no such file; is --out a directory megatok-sweep wrote?")
    manifest = json.loads((out / "sweep.json").read_text())
    rows = []
    for run in manifest["runs"]:
        row = {**run, "status": "not started"}
        if (Path(run["run_dir"]) / "metrics.jsonl").is_file():
            metrics = read_metrics(run["run_dir"])
            train = [r for r in metrics if r.get("split") == "train"]
            val = [r for r in metrics if r.get("split") == "val"]
            cfg = load_config(run["config"], world_size=run["world"])
            rate = flops.realised_rate(cfg, train)
            fpb = flops.flops_per_byte(cfg, rate=rate)["training"]
            flops_at = flops.flops_at(cfg, run["world"], train)
            row.update(status="finished" if any(v["step"] == run["max_steps"] for v in val) else
                       f"running (step {train[-1]['step'] if train else 0})",
                       realised_rate=rate, realised_flops_per_byte=fpb,
                       curve=[(flops_at(v["step"]), v["val_bpb"]) for v in val])
            if val:
                last = val[-1]
                row.update(val_bpb=last["val_bpb"], val_bytes_per_chunk=last.get("val_bytes_per_chunk"),
                           boundary_rule=last.get("boundary_rule"), step=last["step"],
                           flops_done=flops_at(last["step"]))
        rows.append(row)
    write_table(rows, out / "results.md")
    plot(rows, out / "loss_vs_flops.png")
    compare_runs([r["run_dir"] for r in rows], out / "compare")
    return rows


def compare_runs(run_dirs: list[str], out: Path) -> None:
    """The compare tool's table and curves (megatok-compare) for the runs that have started."""
    started = [d for d in run_dirs if (Path(d) / "config.json").is_file() and (Path(d) / "metrics.jsonl").is_file()]
    if not started:
        return
    try:
        compare.compare(started, out)
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
    else:
        print(f"sweep: compare tool's table in {out / 'compare.md'}")


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def write_table(rows: list[dict], path: Path) -> None:
    lines = ["| run | params | strategy | FLOPs/byte (target) | realised rate | FLOPs/byte (realised) | step | "
             "training FLOPs | val bpb | bytes/chunk | boundary rule | status |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.0f}M | {r['strategy']} | {r['flops_per_byte']:.3g} | "
                     f"{_fmt(r.get('realised_rate'), '.3f')} | {_fmt(r.get('realised_flops_per_byte'), '.3g')} | "
                     f"{r.get('step', '-')} | {_fmt(r.get('flops_done'), '.3g')} | {_fmt(r.get('val_bpb'), '.4f')} | "
                     f"{_fmt(r.get('val_bytes_per_chunk'), '.2f')} | {r.get('boundary_rule') or '-'} | {r['status']} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    strategies = sorted({r["strategy"] for r in rows})
    colors = dict(zip(strategies, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    for s in strategies:
        done = sorted((r for r in rows if r["strategy"] == s and "val_bpb" in r), key=lambda r: r["flops_done"])
        for r in done:
            if len(r["curve"]) > 1:
                ax.plot(*zip(*r["curve"]), color=colors[s], alpha=0.3, linewidth=1)
        if done:
            ax.plot([r["flops_done"] for r in done], [r["val_bpb"] for r in done], "o-", color=colors[s], label=s)
            for r in done:
                ax.annotate(r["size"], (r["flops_done"], r["val_bpb"]), fontsize=8, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (at the realised boundary rate)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("megatok sweep: loss against training FLOPs")
    if strategies:
        ax.legend(title="strategy")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep(settings: Settings) -> int:
    """What megatok-sweep does with ``settings``: --collect, or write the configs and then --emit sbatch or
    --run-local; the exit status. SweepError or ConfigError (one line) on bad input, before anything is
    written."""
    out = Path(settings.out)
    if settings.collect:
        collect(out)
        print(f"sweep: wrote {out / 'results.md'} and {out / 'loss_vs_flops.png'}")
        return 0
    if settings.run_local and settings.nproc is None:
        import torch

        settings = replace(settings, nproc=max(1, torch.cuda.device_count()))
    sizing.quiet_deepspeed_import()
    runs = write(settings)
    if settings.emit == "sbatch":
        lines = sbatch_lines(runs, settings.nodes, settings.gpus)
        (out / "submit.sh").write_text("#!/bin/bash\nset -e\n" + "\n".join(lines) + "\n")
        print("\n".join(lines))
    if settings.run_local:
        return run_local(runs, settings.nproc)
    return 0
