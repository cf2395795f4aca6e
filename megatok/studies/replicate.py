"""The replication study in one command: train every method, evaluate, write the evidence table.

    megatok-replicate --preset cpu-small --out docs/replication/cpu-small [--seeds 3] [--work DIR]
                      [--methods policy,policy-vr,uniform,...] [--set KEY=VALUE ...]
                      [--shards DIR --heldout FILE... --parallel FILE...]   (data of a "given" preset, or others)
                      [--handover METHOD:STEPS]

Presets (megatok/studies/replication.py): ``toy`` (a test: minutes), ``cpu-small`` (2 CPU cores, about 4
hours a seed), ``gpu-18m`` (one GPU), ``node-147m`` (the published run, 8 GPUs). For each seed and method
(megatok.studies.replication.METHODS: the policy with the published estimator, with the best variance
reduction and with gamma 1, hnet, gumbel, uniform, fixed, whitespace, and the BPE token model matched in
FLOPs per byte) it writes a complete config under WORK/configs, trains it (WORK/runs/<method>-seed<seed>),
and evaluates the final checkpoint on held-out prose (sampled boundaries, seed 0; the policies also by the
threshold rule) and on the parallel multilingual set. Everything is at equal training bytes (the same steps, batch and window;
the BPE model's window covers the same bytes) and equal FLOPs per byte at inference.

Outputs in --out: results.json (every figure, per run and aggregated), results.md (tables: held-out prose,
verdict, threshold rule, time to alignment, per domain, per language with max/min disparity),
bpb_vs_flops.png, alignment.png, boundaries.png/.html (every method on the same sentences), command.txt.
They are rewritten after every run, so a study stopped part way has the tables of the runs it finished
(the header says how many); boundaries.png comes at the end.

With ``--handover whitespace:200`` every method starts instead from the weights of a whitespace run of its
seed at step 200 (trained first, the first 200 steps of the preset's schedule, or of train.schedule_steps)
and trains the preset's remaining steps with seed + 10; the source runs are not in the tables, and such a
study has its own --out.

It resumes: data, tokenizer and configs are reused, finished runs are skipped, an interrupted run resumes
from its last checkpoint, evaluations already made for a run's final checkpoint are kept. Kill it and
rerun the same command; ``--report-only`` writes the tables of what has finished, training nothing
(the recorded command leaves the flag out). In a fresh clone, whose --work is gone, the runs recorded in
OUT/results.json with the same config are kept instead of trained again, so a study committed half
done goes on where it stopped. Exit status 2 with one error line on bad input.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from megatok import bpe_config, sizing
from megatok.config import ConfigError, find_config, load_config
from megatok.data import corpus as corpus_files
from megatok.data import tokenizer
from megatok.data.documents import DataError
from megatok.data.shards import build_shards, usable_cpus
from megatok.eval.evaluate import evaluate_run
from megatok.eval.policy_probe import probe_run
from megatok.eval.segments import show_boundaries
from megatok.studies import control as control_study
from megatok.studies.launch import (CHECKOUT, Budget, BudgetSpent, StudyStopped, finished, log, stop_signals,
                                    train)
from megatok.studies.replication import (METHODS, POLICY_METHODS, SENTENCES, Handover, Preset, aggregate, markdown,
                                         plots, run_name, run_summary)


def step(shown: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), the library call of the command a user would type for it (``shown``, e.g.
    "megatok-build-shards --out DIR"), in this process (training alone runs in its own processes); its
    result. Bad input it raises, or an exit status other than 0 it returns (its error printed), is a
    RuntimeError naming ``shown``."""
    try:
        result = fn(*args, **kwargs)
    except (ConfigError, DataError, ValueError, OSError) as e:
        raise RuntimeError(f"{shown} failed: {' '.join(str(e).split())}") from None
    if isinstance(result, int) and result:
        raise RuntimeError(f"{shown} failed (exit {result}; its error is above)")
    return result


def shards_of(corpus: Path, shards: Path, num_shards: int) -> None:
    """megatok-build-shards CORPUS --out SHARDS --val-fraction 0.01 --num-shards N, with as many workers
    as the CPUs this process may use (the shards are the same for any number)."""
    m = step(f"megatok-build-shards {corpus} --out {shards}", build_shards, [str(corpus)], str(shards),
             val_fraction=0.01, num_shards=num_shards, progress=False, workers=usable_cpus())
    log(f"wrote {shards}: {m['documents']['train'] + m['documents']['val']} documents in {len(m['train'])} train "
        f"and {len(m['val'])} val shards")


# ----------------------------------------------------------------------------- data

def balanced(src: list[str], out: Path, max_bytes: int) -> Path:
    """Whole held-out documents, about max_bytes in all, an equal share per domain (in file order), so
    every domain is scored whatever order the file keeps."""
    from megatok.data.inputs import read_documents

    docs = list(read_documents(src, "val"))
    domains = sorted({d.domain or "unknown" for d in docs})
    share, used, keep = max_bytes // max(1, len(domains)), {}, []
    for d in docs:
        dom = d.domain or "unknown"
        if used.get(dom, 0) < share:
            used[dom] = used.get(dom, 0) + len(d.text)
            keep.append({"text": d.text.decode("utf-8", "replace"), "lang": d.lang, "domain": dom})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in keep))
    os.replace(tmp, out)
    return out


def prepare_data(preset: Preset, work: Path, given: dict, level: float | None = None) -> dict:
    """Shards, held-out prose and parallel sets: ``given`` on the command line ({"shards", "heldout",
    "parallel"}), or built once under WORK/data (the control: the corpus of ``level``)."""
    data = work / ("data" if preset.signal == 4 else f"data-signal{preset.signal}")
    if preset.data == "control":
        corpus, heldout = data / "control.jsonl.gz", data / "control_heldout.jsonl.gz"
        if not heldout.is_file():
            signal = "" if preset.signal == 4 else f" --signal {preset.signal}"
            log(f"building the control corpus at level {level:g} (megatok-make-corpus --preset control{signal})")
            step(f"megatok-make-corpus --preset control --level {level:g}{signal} --out {corpus}",
                 corpus_files.make_control, corpus, level=level, heldout_out=heldout, signal=preset.signal)
        shards = data / "control_shards"
        if not (shards / "manifest.json").is_file():
            shards_of(corpus, shards, 4)
        eval_file = data / "eval_control.jsonl"
        if not eval_file.is_file():
            balanced([str(heldout)], eval_file, preset.eval_max_bytes)
        return {"shards": str(shards), "heldout": [str(eval_file)], "parallel": []}
    if given["shards"] or preset.data == "given":
        if not (given["shards"] and given["heldout"]):
            raise ConfigError(f"preset {preset.name} takes its data from --shards and --heldout (and --parallel)")
        shards, heldout, parallel = given["shards"], given["heldout"], given["parallel"]
        if not Path(shards, "manifest.json").is_file():
            raise ConfigError(f"--shards {shards}: not a shard directory (no manifest.json; build one with "
                              f"megatok-build-shards)")
        for f in [*heldout, *(parallel or [])]:
            if not Path(f).exists():
                raise ConfigError(f"--heldout/--parallel {f}: no such file")
    else:
        shards, heldout, parallel = data / "prose_shards", [str(data / "prose_heldout.jsonl.gz")], [str(data / "heldout_udhr.jsonl")]
        cache = work.parent / ".cache"
        if not Path(heldout[0]).is_file():
            log("building the prose corpus (megatok-make-corpus --preset prose)")
            step(f"megatok-make-corpus --preset prose --strict --out {data / 'prose.jsonl.gz'}",
                 corpus_files.make_prose, data / "prose.jsonl.gz", heldout_out=Path(heldout[0]), cache=cache,
                 strict=True)
        if not Path(parallel[0]).is_file():
            log("building the parallel UDHR held-out set")
            step(f"megatok-make-corpus --sources udhr --heldout-out {parallel[0]}", corpus_files.make_default,
                 data / "udhr.jsonl.gz", sources=["udhr"], heldout_out=Path(parallel[0]), cache=cache)
        if not (shards / "manifest.json").is_file():
            log("building shards")
            shards_of(data / "prose.jsonl.gz", shards, 8)
        shards = str(shards)
    eval_prose = data / "eval_prose.jsonl"
    if not eval_prose.is_file():
        balanced(heldout, eval_prose, preset.eval_max_bytes)
    return {"shards": str(shards), "heldout": [str(eval_prose)], "parallel": list(parallel or [])}


# ----------------------------------------------------------------------------- configs and training

def write_configs(preset: Preset, work: Path, data: dict, seeds: list[int], methods: list[str],
                  extra: list[str], nproc: int, level: float | None = None,
                  handover: Handover | None = None) -> list[dict]:
    """One complete config per (method, seed), validated for ``nproc`` ranks before anything trains (for the
    control, of the corpus at ``level``: WORK is that level's directory). With a ``handover``, each seed's
    source run first (role "source", under WORK/handover-TAG/, as the methods' runs), then the methods'
    runs, each starting from the source's checkpoint."""
    runs = []
    config = str(CHECKOUT / preset.config if (CHECKOUT / preset.config).is_file() else find_config(preset.config))
    phases = handover_phases(config, handover, [*preset.overrides, *extra], nproc) if handover else None
    home = work / f"handover-{handover.tag}" if handover else work
    for seed in seeds:
        arm_items, source, handed = [], None, None
        if handover:
            source = write_config(preset, config, home, data, handover.source, seed, extra, nproc, level,
                                  [f"train.run_dir={home / 'runs' / run_name('source-' + handover.source, seed)}",
                                   *phases["source"]])
            source["role"] = "source"
            runs.append(source)
            arm_items = [f"train.seed={seed + handover.SEED_OFFSET}", *phases["arm"],
                         f"train.init_from={Path(source['run_dir']) / 'checkpoints' / f'step{handover.steps:08d}'}"]
            handed = {"handover": handover.tag, "source": source["digest"]}
        for m in methods:
            if m == "bpe":
                runs.append(write_bpe_config(preset, config, work, data, seed, extra, nproc, level))
                continue
            runs.append(write_config(preset, config, home, data, m, seed, extra, nproc, level, arm_items, handed))
            if source is not None:
                runs[-1].update(handover=handover.tag, source=source)
    return runs


def handover_phases(config: str, handover: Handover, overrides: list[str], nproc: int) -> dict:
    """--set items of the hand-over's two phases: the source trains the first ``steps`` of the schedule
    (train.schedule_steps, by default the preset's max_steps), the methods the preset's remaining steps."""
    t = load_config(config, overrides=overrides, world_size=nproc).train
    if not 0 < handover.steps < t.max_steps:
        raise ConfigError(f"--handover {handover.source}:{handover.steps}: the source's steps must be between 0 and "
                          f"train.max_steps ({t.max_steps}), which the methods' runs complete")
    return {"source": [f"train.max_steps={handover.steps}", f"train.schedule_steps={t.schedule_steps or t.max_steps}"],
            "arm": [f"train.max_steps={t.max_steps - handover.steps}"]}


def write_config(preset: Preset, config: str, work: Path, data: dict, method: str, seed: int, extra: list[str],
                 nproc: int, level: float | None, phase: list[str] = (), handover: dict | None = None) -> dict:
    """WORK/configs/<method>-seed<seed>.json for a byte method (``phase``: --set items after every other, a
    hand-over's; ``handover``: what the run is handed from, for its digest), written once; its run's record."""
    tags = [method, f"seed{seed}"] + ([f"level{level:g}"] if level is not None else [])
    items = [f"train.seed={seed}", f"train.run_dir={work / 'runs' / run_name(method, seed)}",
             f"data.shards={data['shards']}", f"logging.wandb_group=replicate-{preset.name}",
             f"logging.wandb_tags={json.dumps(tags)}", *preset.overrides, *extra, *METHODS[method][0], *phase]
    cfg = load_config(config, overrides=items, world_size=nproc)
    run_dir = Path(cfg.train.run_dir)
    path = work / "configs" / f"{run_dir.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        raw = cfg.to_dict()
        raw["train"]["grad_accum"] = None  # derived again by the launched ranks
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(raw, indent=2) + "\n")
        os.replace(tmp, path)
    return {"name": run_dir.name if level is None else f"{run_dir.name}-level{level:g}", "method": method,
            "seed": seed, "level": level, "config": str(path), "run_dir": str(run_dir),
            "max_steps": cfg.train.max_steps, "digest": config_digest(cfg, handover)}


def write_bpe_config(preset: Preset, config: str, work: Path, data: dict, seed: int, extra: list[str], nproc: int,
                     level: float | None) -> dict:
    """WORK/configs/bpe-seed<seed>.json, the BPE token model matched to the preset (its tokenizer trained
    on the shards first, once); its run's record."""
    name, tok = run_name("bpe", seed), work / "bpe-tokenizer"
    path, run_dir = work / "configs" / f"{name}.json", work / "runs" / name
    common = [f"train.seed={seed}", f"train.run_dir={run_dir}", f"data.shards={data['shards']}", *preset.overrides,
              *extra]
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (tok / "tokenizer.model").is_file():
        log(f"training the BPE tokenizer ({preset.bpe_vocab} pieces) on {data['shards']}")
        step(f"megatok-train-bpe --data {data['shards']} --out {tok}", tokenizer.train, [data["shards"]],
             preset.bpe_vocab, str(tok), heldout=[*data["heldout"], *data["parallel"]])
    if not path.is_file():
        sizing.quiet_deepspeed_import()
        step(f"megatok-match-bpe --config {config} --out {path}", bpe_config.write_matched, config, str(path),
             tokenizer=str(tok), run_dir=str(run_dir), overrides=common)
    cfg = load_config(str(path), world_size=nproc)
    return {"name": name if level is None else f"{name}-level{level:g}", "method": "bpe", "seed": seed,
            "level": level, "config": str(path), "run_dir": str(run_dir), "max_steps": cfg.train.max_steps,
            "digest": config_digest(cfg)}


#: Config keys added after studies were recorded: left out of the digest while they hold these values (what
#: the recorded runs trained with), so a new key never makes a finished run a new experiment.
ADDED_KEYS = {("model", "byte_window"): None, ("model", "chunk_capacity"): None, ("model", "static_chunks"): False,
              ("boundary", "estimator"): "reinforce", ("boundary", "position"): "after",
              ("boundary", "lag"): 0, ("train", "init_from"): None,
              ("train", "schedule_steps"): None, ("boundary", "lr_scale"): 1.0, ("boundary", "start_step"): 0,
              ("boundary", "lr_warmup_steps"): 0, ("boundary", "explore"): 0.0, ("boundary", "entropy"): 0.0,
              ("boundary", "explore_steps"): 0, ("boundary", "start_ema"): 0.95, ("boundary", "lr_hold"): False,
              ("model", "pack_chunks"): None, ("train", "deterministic"): False}


def config_digest(cfg, handover: dict | None = None) -> str:
    """What makes two runs the same experiment: the resolved config without where its files are (and
    without keys added since, at the value every earlier run had: ADDED_KEYS); for a hand-over's method,
    the source's digest and step (``handover``) in place of the path its weights come from."""
    raw = cfg.to_dict()
    if handover is not None:
        raw["train"].pop("init_from")
        raw["handover"] = handover
    raw["train"].pop("run_dir", None)
    for key in ("wandb_group", "wandb_tags", "tensorboard"):  # where it is logged, not what is trained
        raw.get("logging", {}).pop(key, None)
    raw["data"].pop("shards", None)
    raw["model"].pop("tokenizer", None)
    for (section, key), value in ADDED_KEYS.items():
        if key in raw[section] and raw[section][key] == value:
            del raw[section][key]
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def run_key(run: dict) -> tuple:
    """What names a run within a study: (method, seed, level), the level None outside the control."""
    return run["method"], run["seed"], run.get("level")


def earlier_results(out: Path) -> dict:
    """{(method, seed, level): summary} of the runs an earlier invocation recorded in OUT/results.json: a
    study resumed in a fresh checkout keeps them when their run directories are gone."""
    try:
        runs = json.loads((out / "results.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return {}
    return {run_key(r): r for r in runs if r.get("config_digest") and "prose-sample" in r}


def evaluation_jobs(run: dict, data: dict) -> list[tuple[str, list[str], str, Path]]:
    """(name, files, boundary rule, output) of each evaluation the tables need from a finished run."""
    jobs = [("prose-sample", data["heldout"], "sample")]
    if data["parallel"]:
        jobs.append(("parallel-sample", data["parallel"], "sample"))
    if run["method"] in POLICY_METHODS:
        jobs.append(("prose-threshold", data["heldout"], "threshold"))
    return [(name, files, rule, Path(run["run_dir"]) / f"eval-{name}.json") for name, files, rule in jobs]


def latest_checkpoint(run: dict) -> str:
    return (Path(run["run_dir"]) / "checkpoints" / "latest").read_text().strip()


def current(out: Path, latest: str) -> bool:
    """Whether the evaluation ``out`` exists and is of checkpoint ``latest``."""
    return out.is_file() and json.loads(out.read_text()).get("checkpoint") == latest


def evaluated(run: dict, data: dict) -> bool:
    """Whether a finished run has every evaluation, each of its latest checkpoint."""
    return finished(run) and all(current(out, latest_checkpoint(run)) for *_, out in evaluation_jobs(run, data))


def evaluate(run: dict, data: dict) -> None:
    """eval-prose-sample.json, eval-parallel-sample.json and, for the policies, eval-prose-threshold.json
    in the run directory, each for the run's latest checkpoint (made again when that changed)."""
    latest = latest_checkpoint(run)
    for name, files, rule, out in evaluation_jobs(run, data):
        if current(out, latest):
            continue
        log(f"{run['name']}: evaluating on {name}")
        try:
            res = evaluate_run(run["run_dir"], files, boundary=rule, seed=0, progress=False)
        except (DataError, FileNotFoundError, ConfigError) as e:
            raise RuntimeError(f"evaluating {run['name']} on {name}: {e}") from None
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2, allow_nan=False) + "\n")
        os.replace(tmp, out)


def boundaries_picture(runs: list[dict], out: Path, tokenizer: Path) -> None:
    """Every byte method's first finished run on SENTENCES (kept as it is while some method's runs were
    only kept from an earlier invocation's results.json: their models are not here to draw)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:  # as report's plots
        return
    firsts = {}
    for r in runs:
        if r["method"] != "bpe" and r["method"] not in firsts and finished(r):
            firsts[r["method"]] = r["run_dir"]
    if not firsts or len(firsts) < len({r["method"] for r in runs if r["method"] != "bpe"}):
        return
    rules = ([f"bpe:model_path={tokenizer / 'tokenizer.model'}"] if (tokenizer / "tokenizer.model").is_file()
             else [])
    step(f"megatok-show-boundaries --out {out / 'boundaries'}", show_boundaries, SENTENCES.encode("utf-8"),
         list(firsts.values()), rules, width=96, out=str(out / "boundaries"),
         title="chunk starts: " + ", ".join(firsts) + (", BPE tokens" if rules else "") + " (sampled, seed 0)")


# ----------------------------------------------------------------------------- the study

def run_study(preset: Preset, *, out: Path, work: Path, nproc: int, seeds: list[int], levels: list, methods: list[str],
              overrides: list[str], given: dict, report_only: bool, invocation: str,
              handover: Handover | None = None, prepare_only: bool = False, budget_s: float | None = None) -> int:
    """The study of ``preset`` for these seeds, methods and (the control's) levels: data, configs, training
    on ``nproc`` ranks per run (none with ``report_only``), evaluations and the report in ``out`` (the
    command recorded: ``invocation``), resuming whatever is done. ``given``: {"shards", "heldout",
    "parallel"} from the command line, or None each. ``handover``: every method starts from a source run's
    checkpoint (each seed's source trained first, not in the tables). ``prepare_only``: data and configs,
    nothing else. ``budget_s``: the wall-clock budget (:class:`Budget`). The exit status: 2 on bad input, 1
    when a run fails, 3 when the budget ran out first, 143 on SIGTERM or SIGHUP (the running run stopped at
    a checkpoint, the tables written)."""
    budget = Budget(budget_s)
    datas, runs = {}, []
    try:
        check_same_study(out, handover)
        for level in levels:
            where = work if level is None else work / f"level{level:g}"
            datas[level] = prepare_data(preset, where, given, level)
            runs += write_configs(preset, where, datas[level], seeds, methods, overrides, nproc, level, handover)
    except (ConfigError, DataError, RuntimeError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if prepare_only:
        log(f"prepared: data under {work} and {len(runs)} run config(s); nothing trained")
        return 0
    if not (CHECKOUT / "launch/pretrain.py").is_file() and not report_only and not all(finished(r) for r in runs):
        print(f"error: megatok-replicate trains with launch/pretrain.py of a megatok checkout; there is none in "
              f"{CHECKOUT} (run it from a clone: bash tools/setup.sh installs megatok editable)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    earlier = earlier_results(out)
    studied = [r for r in runs if r.get("role") != "source"]  # a hand-over's sources train, not in the tables
    for run in studied:  # decided up front, so a report written part way keeps them too
        kept = earlier.get(run_key(run))
        if not finished(run) and kept is not None and kept["config_digest"] == run["digest"]:
            run["kept"] = kept
        elif evaluated(run, datas[run["level"]]):
            run["evaluated"] = True
    # runs recorded by other invocations into the same OUT (other methods, seeds or levels) stay in the tables
    others = [r for key, r in earlier.items() if key not in {run_key(run) for run in studied}]
    with stop_signals():
        return _run_all(runs, studied, others, datas, preset, out=out, work=work, nproc=nproc, seeds=seeds,
                        methods=methods, report_only=report_only, invocation=invocation, handover=handover,
                        budget=budget)


def _run_all(runs, studied, others, datas, preset, *, out, work, nproc, seeds, methods, report_only, invocation,
             handover, budget) -> int:
    """run_study's runs in order (a hand-over's sources first), each trained, evaluated and reported."""
    try:
        for i, run in enumerate(runs, 1):
            if run.get("role") == "source":
                train_source(run, [r for r in runs if r.get("source") is run], f"[{i}/{len(runs)}]", nproc,
                             report_only, budget)
                continue
            if "kept" in run:
                log(f"[{i}/{len(runs)}] {run['name']}: kept from {out / 'results.json'} (its run directory is gone)")
                continue
            if finished(run):
                log(f"[{i}/{len(runs)}] {run['name']}: finished already")
            elif report_only:
                log(f"[{i}/{len(runs)}] {run['name']}: not finished (--report-only: not trained)")
                continue
            else:
                log(f"[{i}/{len(runs)}] {run['name']}: training")
                train(run, nproc, budget)
            if not evaluated(run, datas[run["level"]]):
                budget.check(f"{run['name']} not evaluated")
            evaluate(run, datas[run["level"]])
            run["evaluated"] = True
            if preset.data == "control":
                probe_level(run, runs, datas[run["level"]], out)
            if i < len(runs):  # the tables so far: a kill keeps every finished run
                report(studied, others, methods, preset, seeds, out, invocation, handover)
        if preset.data != "control":
            boundaries_picture(runs, out, work / "bpe-tokenizer")
    except (BudgetSpent, StudyStopped) as e:
        report(studied, others, methods, preset, seeds, out, invocation, handover)
        done = sum(1 for r in studied if r.get("evaluated") or "kept" in r)
        print(f"megatok-replicate: {e}; {done} of {len(studied)} runs finished, in {out / 'results.md'}; the same "
              f"command resumes", file=sys.stderr)
        return 3 if isinstance(e, BudgetSpent) else 143
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    written = report(studied, others, methods, preset, seeds, out, invocation, handover)
    log(f"wrote {out / 'results.md'}, results.json, {', '.join(written)}")
    return 0


def check_same_study(out: Path, handover: Handover | None) -> None:
    """OUT/results.json, where an earlier invocation wrote one, is of a study handed over the same way (or
    of one not handed over, as this one): methods' runs of different studies never share a table."""
    try:
        recorded = json.loads((out / "results.json").read_text()).get("handover")
    except (OSError, ValueError):
        return
    if recorded != (handover.record() if handover else None):
        was = f"handed over from {recorded['source']}:{recorded['steps']}" if recorded else "not handed over"
        now = f"--handover {handover.source}:{handover.steps}" if handover else "no --handover"
        raise ConfigError(f"{out / 'results.json'} records a study {was}; this one has {now}: give it its own --out")


def train_source(source: dict, arms: list[dict], counter: str, nproc: int, report_only: bool,
                 budget: Budget = Budget(None)) -> None:
    """A hand-over's source run, trained unless it is finished or every method's run it starts is."""
    if all("kept" in r or finished(r) for r in arms):
        log(f"{counter} {source['name']}: not needed (every run it starts is finished)")
    elif finished(source):
        log(f"{counter} {source['name']}: finished already")
    elif report_only:
        log(f"{counter} {source['name']}: not finished (--report-only: not trained)")
    else:
        log(f"{counter} {source['name']}: training the hand-over's source")
        train(source, nproc, budget)


def probe_level(run: dict, runs: list[dict], data: dict, out: Path) -> None:
    """OUT/boundary_value-level<L>.json: megatok-boundary-value on the level's uniform run of the first seed
    (the value of a chunk start per class of positions, for a model trained without a preference where
    chunks start, and the return noise the estimator meets on it), once that run is evaluated."""
    firsts = [r for r in runs if r["method"] == "uniform" and r["level"] == run["level"]]
    target = out / f"boundary_value-level{run['level']:g}.json"
    if not firsts or run is not firsts[0] or target.is_file():
        return
    log(f"{run['name']}: the value of a chunk start by class (megatok-boundary-value)")
    step(f"megatok-boundary-value --run {run['run_dir']} --out {target}", probe_run, run["run_dir"],
         data=data["heldout"][0], rounds=16, batch_size=16, out=target)


def report(runs: list[dict], others: list[dict], methods: list[str], preset: Preset, seeds: list[int], out: Path,
           command: str, handover: Handover | None = None) -> list[str]:
    """results.json, results.md, command.txt and the plots for the runs evaluated or kept so far, and the
    runs other invocations recorded in OUT (``others``)."""
    done = [r for r in runs if "kept" in r or r.get("evaluated")]
    summaries = [r["kept"] if "kept" in r else {**run_summary(Path(r["run_dir"]), r["method"], r["seed"], r["level"]),
                                                "config_digest": r["digest"],
                                                **({"handed_over_from": r["source"]["run_dir"]} if "source" in r
                                                   else {})} for r in done]
    summaries = others + _relative(summaries, f"{Path.cwd()}{os.sep}")
    summaries.sort(key=lambda r: (r.get("level") or 0, list(METHODS).index(r["method"]), r["seed"]))
    commands = list(dict.fromkeys([*earlier_commands(out), command]))
    missing = [r["name"] for r in runs if r not in done]
    progress = (f" {len(summaries)} runs in the tables" + (f"; of the last command's {len(runs)}, not finished yet: "
                f"{', '.join(missing)}" if missing else "") + ".")
    header = (f"# Replication study: preset {preset.name}\n\n{preset.description}.{progress} "
              f"{handover.describe(runs[0]['max_steps']) + ' ' if handover and runs else ''}"
              f"{'Commands' if len(commands) > 1 else 'Command'}: {', '.join(f'`{c}`' for c in commands)}. Tables "
              f"written {time.strftime('%Y-%m-%d')} on {machine()} (runs kept from earlier invocations may have trained "
              f"on other machines).")
    if preset.data == "control":
        summaries = [{**s, **control_study.run_figures(s, preset.aligned_key)} for s in summaries]
        agg = control_study.aggregate(summaries, control_study.read_probes(out))
        text = control_study.markdown(agg, header)
    else:
        recorded = [m for m in METHODS if m not in methods and any(s["method"] == m for s in summaries)]
        agg = aggregate(summaries, [*methods, *recorded])  # other invocations' methods stay in the tables
        text = markdown(agg, preset, header)
    seeds_seen = sorted({r["seed"] for r in summaries} | set(seeds))
    for name, content in (("results.json", json.dumps({"preset": preset.name, "seeds": seeds_seen, "command": command,
                                                       "commands": commands,
                                                       "handover": handover.record() if handover else None,
                                                       "aggregate": agg, "runs": summaries},
                                                      indent=1) + "\n"),
                          ("results.md", text), ("command.txt", "\n".join(commands) + "\n")):
        tmp = out / f".{name}.tmp"  # replaced whole: a kill never leaves a torn results.json
        tmp.write_text(content)
        os.replace(tmp, out / name)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a GPU image may lack it: the tables are the results, the plots a view of them
        log("no matplotlib here: the tables are written, the plots are not (pip install matplotlib; --report-only)")
        return []
    if preset.data == "control":
        return control_study.plots(summaries, agg, out, preset.aligned_key)
    return plots(summaries, agg, out)


def earlier_commands(out: Path) -> list[str]:
    """The commands recorded in OUT/results.json by earlier invocations."""
    try:
        recorded = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return []
    return recorded.get("commands") or ([recorded["command"]] if recorded.get("command") else [])


def _relative(obj, prefix: str):
    """Paths under the working directory written relative to it: results.json names no machine's paths."""
    if isinstance(obj, dict):
        return {k: _relative(v, prefix) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relative(v, prefix) for v in obj]
    return obj[len(prefix):] if isinstance(obj, str) and obj.startswith(prefix) else obj


def machine() -> str:
    import torch

    from megatok.metrics import cpu_name

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} x {cpu_name()}{gpu}"

