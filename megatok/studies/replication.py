"""The replication study: does the score-function policy learn where words start, and what does it buy?

One preset (configs/replication/<preset>.json plus the facts below) trains, at equal training bytes and
equal FLOPs per byte at inference, every method in METHODS for each seed, evaluates them on held-out
prose and on parallel multilingual text, and reports (``megatok-replicate``, megatok/studies/replicate.py).
This module holds the presets and methods, and turns finished runs into the tables and plots.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from megatok.metrics import finite_number, read_metrics

#: The variance reduction chosen for ``policy-vr`` by the screen in
#: docs/replication/notes/2026-12-01-prose-study.md (the figures and the commands that made them are there).
VR_OPTIONS = {"samples": 2}

#: The published estimator's settings where megatok's default differs (its pace: docs/method.md).
PUBLISHED = ("boundary.strategy=policy", "boundary.lr_scale=1.0", "boundary.start_step=0", "boundary.start_margin=null",
             "boundary.lr_hold=false")
#: The policy learning from step 0 with no latch (the pace arms screened before the latch became the default).
UNLATCHED = ("boundary.strategy=policy", "boundary.start_step=0", "boundary.start_margin=null",
             "boundary.lr_hold=false")

#: method -> (--set items for the preset's config, what it is). "bpe" is the sentencepiece BPE token model
#: matched to the preset in training FLOPs per byte (megatok-match-bpe), not a boundary strategy.
METHODS: dict[str, tuple[list[str], str]] = {
    "policy": (["boundary.strategy=policy"], "score function, megatok's default pace (its own parameters at a quarter "
                                             "of the peak learning rate, held, learning once the full model beats the "
                                             "early-exit head)"),
    "policy-published": ([*PUBLISHED], "score function, the published estimator (Dauncey & Wattenhofer)"),
    # the published estimator with one change each
    "policy-vr": ([*PUBLISHED, *(f"boundary.{k}={v}" for k, v in VR_OPTIONS.items())],
                  "score function with the variance reduction found best"),
    "policy-gamma1": ([*PUBLISHED, "boundary.gamma=1.0"], "score function, undiscounted (gamma 1)"),
    "policy-rloo4": ([*PUBLISHED, "boundary.samples=4"],
                     "score function, 4 samples of each sequence, each baselined by the other 3 (leave-one-out)"),
    "policy-disarm": ([*PUBLISHED, "boundary.estimator=disarm", "boundary.samples=2"],
                      "antithetic DisARM over 2 samples of each sequence (u and 1 - u)"),
    "policy-value": ([*PUBLISHED, "boundary.value_baseline=true"],
                     "score function with a learned value baseline on top of the batch baseline"),
    "policy-lag1": ([*PUBLISHED, "boundary.lag=1"],
                    "score function, each decision read from the byte before the start it places (lag 1)"),
    "policy-loo": ([*PUBLISHED, "boundary.leave_one_out=true"],
                   "score function, the batch baseline without the sequence's own reward"),
    "policy-warmup": ([*PUBLISHED, "boundary.start_step=100"],
                      "score function from step 100 (uniform random chunks before)"),
    "policy-lrwarm": ([*PUBLISHED, "boundary.lr_warmup_steps=200"],
                      "score function, its own parameters' learning rate rising from 0 over 200 steps"),
    "policy-explore": ([*PUBLISHED, "boundary.explore=0.5", "boundary.explore_steps=300"],
                       "score function, drawn from (1 - e) p + e rho, e falling from 0.5 to 0 over 300 steps"),
    "policy-entropy": ([*PUBLISHED, "boundary.entropy=0.001", "boundary.explore_steps=300"],
                       "score function with an entropy bonus towards the target rate (0.001, to 0 over 300 steps)"),
    # the pace, screened around the default
    "policy-slow": ([*UNLATCHED, "boundary.lr_scale=0.25"],
                    "score function, its own parameters at a quarter of the learning rate from step 0 (no latch)"),
    "policy-slow10": ([*UNLATCHED, "boundary.lr_scale=0.1"],
                      "score function, its own parameters at a tenth of the learning rate from step 0 (no latch)"),
    "policy-warmslow": ([*UNLATCHED, "boundary.start_step=100"],
                        "policy-slow from step 100 (uniform random chunks before)"),
    "policy-warmslow200": ([*UNLATCHED, "boundary.start_step=200"],
                           "policy-slow from step 200 (uniform random chunks before)"),
    "policy-latch": (["boundary.strategy=policy", "boundary.start_step=50", "boundary.start_margin=0.02",
                      "boundary.lr_hold=false"],
                     "the default before 2026-12-07's second change: a quarter of the model's (decaying) learning "
                     "rate, learning once the full model beats the early-exit head by 0.02 bits per byte (a moving "
                     "average from step 50)"),
    "policy-latchfast": ([*PUBLISHED, "boundary.start_step=50", "boundary.start_margin=0.02"],
                         "the published estimator, learning once the full model beats the early-exit head by 0.02 "
                         "bits per byte (a moving average from step 50)"),
    "policy-slowexplore": ([*UNLATCHED, "boundary.explore=0.5", "boundary.explore_steps=400"],
                           "policy-slow, drawn from (1 - e) p + e rho, e falling from 0.5 to 0 over 400 steps"),
    "hnet": (["boundary.strategy=hnet"], "H-Net cosine router, straight-through, ratio loss"),
    "gumbel": (["boundary.strategy=gumbel"], "Gumbel-sigmoid, straight-through, binomial prior"),
    "uniform": (["boundary.strategy=uniform"], "uniform random positions at the target rate"),
    "fixed": (["boundary.strategy=fixed"], "a chunk every 1/rate bytes"),
    "whitespace": (["boundary.strategy=whitespace"], "a chunk after whitespace or punctuation"),
    "oracle": (["boundary.strategy=whitespace", "boundary.position=at"],
               "a chunk at every separator (whitespace or punctuation) itself: on the control, every position "
               "where a start pays (its oracle)"),
    "bpe": ([], "BPE token model (sentencepiece) at matched FLOPs per byte"),
}
POLICY_METHODS = tuple(m for m in METHODS if m.startswith("policy"))
#: Where a method's chunks start when it aligns with words, if not at the space before a word (sbw): wfb, the
#: word's first byte (a lag-1 policy reacting to the space). Its alignment figures are read there.
ALIGNS_AT = {"policy-lag1": "wfb"}


def aligned_fraction_key(method: str) -> str:
    return f"{ALIGNS_AT.get(method, 'sbw')}_boundary_fraction"


#: The sentences every method's boundaries are drawn on (boundaries.png).
SENTENCES = ("The committee will report on the state of the economy before the end of the year.\n"
             "Enter the king, attended by his lords, and a messenger with letters from France.")


@dataclass(frozen=True)
class Preset:
    name: str
    config: str  # path of the byte model's config, relative to the checkout
    nproc: int  # ranks per training run
    bpe_vocab: int
    methods: tuple[str, ...]
    data: str  # "prose": built by make_corpus --preset prose; "control": --preset control; "given": --shards/...
    eval_max_bytes: int  # held-out bytes scored per set
    description: str
    overrides: tuple[str, ...] = field(default=())
    #: the control's data: how many separators carry the message (megatok.data.control.Control.signal)
    signal: int = 4
    #: the control's alignment figure: the share of the paying positions that start a chunk
    aligned_key: str = "sbw_boundary_fraction"


#: The methods of the prose studies (the control adds the estimators it maps).
ALL = ("policy", "policy-published", "policy-vr", "policy-gamma1", "hnet", "gumbel", "uniform", "fixed", "whitespace",
       "bpe")
PRESETS = {p.name: p for p in (
    Preset("toy", "configs/replication/toy.json", 1, 512, ALL, "given", 20_000,
           "a test: every method for a few steps on a tiny model (minutes on 2 CPU cores)"),
    Preset("control", "configs/replication/control.json", 1, 0,
           ("policy", "policy-published", "policy-disarm", "uniform"), "control", 100_000,
           "the positive control (megatok/data/control.py): byte layers that see one byte, main 192 x 2, 256-byte "
           "windows, 600 steps of 16 sequences on one rank (about 3 minutes a run on one CPU core)"),
    Preset("control-one", "configs/replication/control.json", 1, 0,
           ("policy", "policy-published", "policy-disarm", "uniform", "oracle"), "control", 100_000,
           "the harder control: as the control, but only the space of the four separators carries the message (a start "
           "pays at the spaces before words alone, a quarter of the separators), so the policy must tell the space from "
           "the tab, newline and carriage return; aligned: 0.9 of those spaces start a chunk (space_boundary_fraction)",
           signal=1, aligned_key="space_boundary_fraction"),
    Preset("cpu-small", "configs/replication/cpu-small.json", 2, 4096, ALL, "prose", 600_000,
           "2 CPU cores: byte layers 128 x 1+1, main 384 x 4, 1024-byte windows, prose"),
    Preset("gpu-18m", "configs/replication/gpu-18m.json", 1, 8192,
           ("policy", "policy-published", "policy-vr", "uniform", "fixed", "whitespace", "bpe"), "prose", 2_000_000,
           "the research's smallest model (d 384, 2/6/2 layers) on one GPU, about a minute of training each"),
    Preset("gpu-call", "configs/replication/gpu-18m.json", 1, 8192, ("policy", "uniform", "whitespace"), "prose",
           2_000_000, "gpu-18m's model and steps for megatok's default policy, uniform chunks and whitespace chunks: "
           "one GPU call (tools/gpu_study.sh: --budget-s, the data built here and carried)"),
    Preset("gpu-40m", "configs/replication/gpu-40m.json", 1, 8192,
           ("policy", "policy-published", "policy-vr", "uniform", "fixed", "whitespace", "bpe"), "prose", 2_000_000,
           "the research's ablation scale: 39M parameters (d 512, 2/8/2 layers, byte layers over 64-byte windows), "
           "4096-byte windows, batch 32, 1.5e9 bytes (11,444 steps) on one GPU, checkpoints kept every 2000 steps "
           "for the probe"),
    Preset("node-147m", "configs/replication/node-147m.json", 8, 32768, ALL, "given", 4_000_000,
           "the published run (d 768, 4/12/4 layers, 4096-byte windows, batch 128) on 8 GPUs"),
)}


@dataclass(frozen=True)
class Handover:
    """A study whose methods start from another method's weights: for each seed, ``source`` trains the first
    ``steps`` steps of the preset's schedule (train.schedule_steps, by default the preset's max_steps), and
    every method then trains the preset's remaining steps from that checkpoint (train.init_from), with
    train.seed + SEED_OFFSET (a new data order and new boundary samples: the source's seed would replay its
    batches). Every method still sees the preset's training bytes in all."""
    source: str
    steps: int
    SEED_OFFSET = 10

    @property
    def tag(self) -> str:
        return f"{self.source}{self.steps}"

    def describe(self, more: int) -> str:
        return (f"Handed over: every method starts from the {self.source} run's step-{self.steps} checkpoint of its "
                f"seed and trains {more} more steps (train.seed + {self.SEED_OFFSET}).")

    def record(self) -> dict:
        return {"source": self.source, "steps": self.steps, "seed_offset": self.SEED_OFFSET}


def run_name(method: str, seed: int) -> str:
    return f"{method}-seed{seed}"


# ----------------------------------------------------------------------------- reading finished runs

def _mean_range(values: list[float]) -> dict:
    vals = [v for v in map(finite_number, values) if v is not None]
    if not vals:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def alignment_curve(run_dir: Path) -> list[dict]:
    """The training rows' boundary figures: step, sbw fraction, p at spaces before words and elsewhere, SNR."""
    keys = ("sbw_boundary_fraction", "space_boundary_fraction", "wfb_boundary_fraction", "p_sbw", "p_other", "snr_sbw",
            "boundary_rate", "bpb", "bpb_early")
    return [{"step": r["step"], **{k: r.get(k) for k in keys}}
            for r in read_metrics(run_dir) if r.get("split") == "train"]


def first_step(curve: list[dict], test) -> int | None:
    return next((r["step"] for r in curve if test(r)), None)


def training_seconds(rows: list[dict]) -> float | None:
    """A run's training wall time from its metrics rows' clock, over every start that trained it (the
    first and each resume): the time from each start's first row to its last, plus one median interval
    between training rows for the start-up to that first row. A start's stretch ends at a stop event
    (SIGTERM, RUN_DIR/STOP) or, after a kill, where the steps go back; the time between them is not
    counted. None below two train rows."""
    train = [r for r in rows if r.get("split") == "train" and "time" in r]
    if len(train) < 2:
        return None
    typical = statistics.median(b["time"] - a["time"] for a, b in zip(train, train[1:]) if b["step"] > a["step"])
    total, first, last, step = 0.0, None, None, -1
    for r in rows:
        if "time" not in r:
            continue
        stopped = r.get("split") == "event" and str(r.get("event", "")).startswith("stopped")
        replayed = r.get("split") == "train" and r["step"] <= step
        if first is not None and replayed:  # killed: this row is the next start's
            total += last - first + typical
            first = None
        if first is None:
            first = r["time"]
        last = r["time"]
        if r.get("split") == "train":
            step = r["step"]
        if stopped:
            total += last - first + typical
            first = None
    if first is not None:
        total += last - first + typical
    return total


def run_summary(run_dir: Path, method: str, seed: int, level: float | None = None) -> dict:
    """What the tables need from one finished run: its evaluations, training FLOPs and wall time (and for
    the control, its corpus's level and every byte method's alignment over training)."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("split") == "train"]
    last = train[-1] if train else {}
    out = {"method": method, "seed": seed, **({} if level is None else {"level": level}),
           "run": str(run_dir), "steps": last.get("step"),
           "bytes_seen": last.get("bytes_seen"), "flops": last.get("flops"),
           "realised_rate": _mean([r.get("boundary_rate") for r in train[len(train) // 2:]])}
    if (wall := training_seconds(rows)) is not None:
        out["wall_s"] = wall
    for name in ("prose-sample", "prose-threshold", "parallel-sample"):
        f = run_dir / f"eval-{name}.json"
        if f.is_file():
            out[name] = json.loads(f.read_text())
    if method in POLICY_METHODS or (level is not None and method != "bpe"):
        curve = alignment_curve(run_dir)
        out["curve"] = curve
        out["first_sign_step"] = first_step(curve, lambda r: (r["p_sbw"] or 0) - (r["p_other"] or 0) >= 0.05)
        key = aligned_fraction_key(method)
        out["aligned_step"] = first_step(curve, lambda r: (r.get(key) or 0) >= 0.6)
    return out


def _mean(values):
    vals = [v for v in map(finite_number, values) if v is not None]
    return sum(vals) / len(vals) if vals else None


def aggregate(summaries: list[dict], methods: list[str]) -> dict:
    """Per method, over seeds: mean and range of every reported figure; per language (parallel set)."""
    result = {}
    for m in methods:
        runs = [s for s in summaries if s["method"] == m]
        if not runs:
            continue
        prose = [s.get("prose-sample", {}) for s in runs]
        unit = "bytes_per_token" if m == "bpe" else "bytes_per_chunk"
        entry = {
            "runs": len(runs),
            "bpb": _mean_range([p.get("bpb") for p in prose]),
            "bpb_by_seed": {str(s["seed"]): p.get("bpb") for s, p in zip(runs, prose) if p.get("bpb") is not None},
            "bytes_per_unit": _mean_range([p.get(unit) for p in prose]),
            "sbw_boundary_fraction": _mean_range([p.get("sbw_boundary_fraction") for p in prose]),
            "wfb_boundary_fraction": _mean_range([p.get("wfb_boundary_fraction") for p in prose]),
            "word_start_precision": _mean_range([p.get("word_start_precision") for p in prose]),
            "word_start_recall": _mean_range([p.get("word_start_recall") for p in prose]),
            "realised_rate": _mean_range([s.get("realised_rate") for s in runs]),
            "flops": _mean_range([s.get("flops") for s in runs]),
            "wall_s": _mean_range([s.get("wall_s") for s in runs]),
        }
        thr = [s.get("prose-threshold", {}) for s in runs if "prose-threshold" in s]
        if thr:
            entry["threshold"] = {"bpb": _mean_range([p.get("bpb") for p in thr]),
                                  "sbw_boundary_fraction": _mean_range([p.get("sbw_boundary_fraction") for p in thr]),
                                  "boundary_rate": _mean_range([p.get("boundary_rate") for p in thr])}
        domains = sorted({d for p in prose for d in p.get("by_domain", {})})
        entry["by_domain"] = {d: {"bpb": _mean_range([p.get("by_domain", {}).get(d, {}).get("bpb") for p in prose]),
                                  "sbw_boundary_fraction": _mean_range(
                                      [p.get("by_domain", {}).get(d, {}).get("sbw_boundary_fraction") for p in prose])}
                              for d in domains}
        par = [s.get("parallel-sample", {}) for s in runs]
        langs = sorted({lang for p in par for lang in p.get("by_lang", {})})
        per_lang = {lang: {"bpb": _mean([p.get("by_lang", {}).get(lang, {}).get("bpb") for p in par]),
                           "bytes_per_unit": _mean([p.get("by_lang", {}).get(lang, {}).get(unit) for p in par])}
                    for lang in langs}
        entry["by_lang"] = per_lang
        for k in ("bpb", "bytes_per_unit"):
            vals = [v[k] for v in per_lang.values() if v[k]]
            entry[f"{k}_disparity"] = max(vals) / min(vals) if len(vals) > 1 else None
        if m in POLICY_METHODS:
            entry["first_sign_step"] = [s.get("first_sign_step") for s in runs]
            entry["aligned_step"] = [s.get("aligned_step") for s in runs]
        result[m] = entry
    return result


def _cell(r: dict, spec: str, scale: float = 1.0) -> str:
    if not r or r.get("mean") is None:
        return "n/a"
    if r["n"] == 1:
        return format(r["mean"] * scale, spec)
    return f"{format(r['mean'] * scale, spec)} ({format(r['min'] * scale, spec)}-{format(r['max'] * scale, spec)})"


def verdict(agg: dict) -> list[str]:
    """The goal's two tests, in words, from the aggregate (only where the methods ran)."""
    lines = []
    for m in POLICY_METHODS:
        if m not in agg:
            continue
        key = aligned_fraction_key(m)
        frac = agg[m].get(key, {}).get("mean")
        uniform = agg.get("uniform", {}).get(key, {}).get("mean")
        where = "the first bytes of words after a space" if key.startswith("wfb") else "the spaces before a word"
        if frac is not None:
            lines.append(f"- {m}: {frac:.2f} of {where} start a chunk on held-out prose (goal: at "
                         f"least 0.60{f'; uniform: {uniform:.2f}' if uniform is not None else ''}): "
                         f"{'reached' if frac >= 0.6 else 'not reached'}.")
        for base in ("uniform", "fixed"):
            if base in agg and agg[m]["bpb"]["mean"] is not None and agg[base]["bpb"]["mean"] is not None:
                a, b = agg[m]["bpb"], agg[base]["bpb"]
                gap = b["mean"] - a["mean"]
                figures = f"{a['mean']:.4f} against {b['mean']:.4f} ({m} {'lower' if gap > 0 else 'higher'} by {abs(gap):.4f}"
                if min(a["n"], b["n"]) < 2:
                    lines.append(f"- {m} against {base} on held-out prose bpb: {figures}{same_seed(agg[m], agg[base], m)}); "
                                 f"one seed, so no spread to compare the difference with.")
                    continue
                spread = max(a["max"] - a["min"], b["max"] - b["min"])
                word = "beats" if gap > spread else ("trails" if -gap > spread else "is within the seed spread of")
                lines.append(f"- {m} {word} {base} on held-out prose bpb: {figures}; largest seed spread "
                             f"{spread:.4f}, {a['n']} and {b['n']} seeds){paired(agg[m], agg[base], m, base)}.")
    return lines


def common_seeds(a: dict, b: dict) -> list[str]:
    """The seeds both aggregates have a held-out bpb for, in order."""
    return sorted(set(a.get("bpb_by_seed", {})) & set(b.get("bpb_by_seed", {})), key=int)


def same_seed(a: dict, b: dict, m: str) -> str:
    """Where one method ran one seed and the other several: the difference on the seed both ran (a mean over
    other seeds mixes in the seed's own effect, which here is larger than the methods')."""
    seeds = common_seeds(a, b)
    if len(seeds) != 1 or max(a["bpb"]["n"], b["bpb"]["n"]) < 2:
        return ""
    (s,) = seeds
    gap = b["bpb_by_seed"][s] - a["bpb_by_seed"][s]
    return (f"; on seed {s}, the one both ran: {a['bpb_by_seed'][s]:.4f} against {b['bpb_by_seed'][s]:.4f}, "
            f"{m} {'lower' if gap > 0 else 'higher'} by {abs(gap):.4f}")


def paired(a: dict, b: dict, m: str, base: str) -> str:
    """The difference seed by seed (the same seed: the same data order and initialisation), where both ran."""
    seeds = common_seeds(a, b)
    if len(seeds) < 2:
        return ""
    gains = [b["bpb_by_seed"][s] - a["bpb_by_seed"][s] for s in seeds]
    each = ", ".join(f"{g:+.4f}" for g in gains)
    return (f"; paired by seed, {base} minus {m}: {each} (seeds {', '.join(seeds)}; {m} lower in "
            f"{sum(g > 0 for g in gains)} of {len(gains)})")


def markdown(agg: dict, preset: Preset, header: str) -> str:
    lines = [header, "", "## Held-out prose", "",
             "bpb: bits per byte on held-out prose documents (sampled boundaries, seed 0), mean and (min-max) over "
             "seeds. unit: bytes per chunk (bytes per token for bpe). sbw: fraction of spaces before a word that "
             "start a chunk; wfb: of the words' first bytes after them. P/R: precision and recall of chunk starts "
             "against word starts. rate: realised boundary rate in training. FLOPs: training FLOPs. wall: training wall time.", "",
             "| method | bpb | unit | sbw | wfb | P | R | rate | FLOPs | wall (min) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, e in agg.items():
        lines.append(f"| {m} | {_cell(e['bpb'], '.4f')} | {_cell(e['bytes_per_unit'], '.2f')} | "
                     f"{_cell(e['sbw_boundary_fraction'], '.3f')} | {_cell(e.get('wfb_boundary_fraction'), '.3f')} | "
                     f"{_cell(e['word_start_precision'], '.3f')} | "
                     f"{_cell(e['word_start_recall'], '.3f')} | {_cell(e['realised_rate'], '.3f')} | "
                     f"{_cell(e['flops'], '.2e')} | {_cell(e['wall_s'], '.1f', 1 / 60)} |")
    lines += ["", "## Verdict", "", *verdict(agg)]
    thr = {m: e["threshold"] for m, e in agg.items() if "threshold" in e}
    if thr:
        lines += ["", "## The policies under the threshold rule (p > 0.5)", "", "| method | bpb | sbw | rate |",
                  "|---|---|---|---|"]
        lines += [f"| {m} | {_cell(t['bpb'], '.4f')} | {_cell(t['sbw_boundary_fraction'], '.3f')} | "
                  f"{_cell(t['boundary_rate'], '.3f')} |" for m, t in thr.items()]
    pol = {m: e for m, e in agg.items() if m in POLICY_METHODS}
    if pol:
        lines += ["", "## Time to alignment (training rows)", "",
                  "first sign: first logged step where p at spaces before words exceeds p elsewhere by 0.05; "
                  "aligned: first step where 60% of the spaces before words start a chunk (policy-lag1: of the words' "
                  "first bytes after them; per seed; - never).", "",
                  "| method | first sign | aligned |", "|---|---|---|"]
        lines += [f"| {m} | {', '.join('-' if s is None else str(s) for s in e['first_sign_step'])} | "
                  f"{', '.join('-' if s is None else str(s) for s in e['aligned_step'])} |" for m, e in pol.items()]
    domains = sorted({d for e in agg.values() for d in e["by_domain"]})
    if domains:
        lines += ["", "## bpb and sbw fraction per domain (held-out prose)", "",
                  "| method | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
        for m, e in agg.items():
            cells = [f"{_cell(e['by_domain'].get(d, {}).get('bpb'), '.3f')} / "
                     f"{_cell(e['by_domain'].get(d, {}).get('sbw_boundary_fraction'), '.2f')}" for d in domains]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    langs = sorted({lang for e in agg.values() for lang in e["by_lang"]})
    if langs:
        lines += ["", "## Parallel multilingual text", "",
                  "bytes per unit / bpb per language (same content in every language), and the disparity "
                  "max / min over languages.", "",
                  "| method | " + " | ".join(langs) + " | unit disparity | bpb disparity |",
                  "|---|" + "---|" * (len(langs) + 2)]
        for m, e in agg.items():
            cells = []
            for lang in langs:
                v = e["by_lang"].get(lang, {})
                cells.append("n/a" if v.get("bpb") is None else f"{v['bytes_per_unit'] or float('nan'):.2f} / {v['bpb']:.3f}")
            d1, d2 = e.get("bytes_per_unit_disparity"), e.get("bpb_disparity")
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {'n/a' if d1 is None else f'{d1:.2f}'} | "
                         f"{'n/a' if d2 is None else f'{d2:.2f}'} |")
    return "\n".join(lines) + "\n"


def plots(summaries: list[dict], agg: dict, out: Path) -> list[str]:
    """bpb_vs_flops.png (held-out prose bpb against training FLOPs, every run) and alignment.png (the
    policies' spaces-before-words figures over training)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, m in enumerate(agg):
        pts = [(s["flops"], s["prose-sample"]["bpb"]) for s in summaries
               if s["method"] == m and s.get("flops") and s.get("prose-sample", {}).get("bpb") is not None]
        if pts:
            ax.scatter(*zip(*pts), label=m, color=f"C{i % 10}", marker="os^Dv<>p*h"[i % 10])
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("held-out prose bits per byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bpb_vs_flops.png", dpi=110)
    plt.close(fig)
    written.append("bpb_vs_flops.png")
    curves = [s for s in summaries if s.get("curve")]
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for s in sorted(curves, key=lambda s: (list(POLICY_METHODS).index(s["method"]), s["seed"])):
            # a colour per method, a line style per seed
            style = {"color": f"C{list(POLICY_METHODS).index(s['method'])}", "alpha": 0.8,
                     "ls": ("-", "--", ":", "-.")[s["seed"] % 4]}
            steps = [r["step"] for r in s["curve"]]
            axes[0].plot(steps, [r.get(aligned_fraction_key(s["method"])) for r in s["curve"]],
                         label=f"{s['method']} seed {s['seed']}", **style)
            axes[1].plot(steps, [(r["p_sbw"] or 0) - (r["p_other"] or 0) for r in s["curve"]], **style)
        axes[0].axhline(0.6, ls="--", color="gray", lw=0.8)
        axes[0].set_title("spaces before a word (lag 1: words' first bytes) that start a chunk", fontsize=9)
        axes[1].set_title("p at spaces before words minus p elsewhere")
        axes[1].axhline(0.0, color="gray", lw=0.8)
        for ax in axes:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "alignment.png", dpi=110)
        plt.close(fig)
        written.append("alignment.png")
    return written
