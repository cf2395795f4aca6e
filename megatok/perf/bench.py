"""Benchmark megatok's hot path: every figure a ratio of two things measured in the same run.

    python -m megatok.cli.bench                          # CPU here (one thread), a GPU when present
    python -m megatok.cli.bench --quick                  # fewer repetitions and bytes (a smoke run)
    python -m megatok.cli.bench --json-out bench.json --reps 7 --threads 1
    python -m megatok.cli.bench --profile small/policy   # one variant's step by part (torch.profiler)
    python -m megatok.cli.bench --inference              # generation: byte model and matched BPE model, batch 1 and 8

The timed variants are built once and then run in turns, because the machine may be shared: ``--reps``
rounds, each of ``--steps`` steps of every training variant one step at a time (in a rotating order),
then everything else once. A ratio is taken within each round, and the table gives its median and its
spread (min-max over the rounds). On a CPU with one thread the clock is the process's CPU time, so
time spent waiting for a core that others use is not counted; elsewhere it is wall time. Figures:

- **policy share**: (step time with the policy - with fixed boundaries) / step time with the policy,
  same shape and data: what the learned boundaries' machinery (the head, the draw, the losses) costs.
  Also for the policy with ``boundary.window=3`` (decisions conditioned on the previous two).
- **megatok / every byte**: time per byte of megatok against the same model with a chunk at every
  byte (fixed boundaries at stride 1, so the main network runs at byte rate), at the tiny shape
  (configs/tiny.json) and at a small shape with the 1b config's proportions (byte layers 128 wide,
  1 + 1 of them; main network 384 wide, 6 layers).
- **MFU**: model FLOPs per second (megatok.flops at the realised boundary rate, training = 3 x
  forward) over a square matmul's FLOP/s measured in the same rounds (fp32 on a CPU, bf16 on a GPU).
- **data / step**: bytes per second one reader of the data pipeline (megatok.data.stream over
  shards built here from the Python standard library's sources) produces, over the bytes per
  second a training step of the tiny shape consumes on one rank.
- **eval / train** and **generate / train**: bytes per second of megatok.eval.bpb.evaluate_documents
  (what megatok-evaluate and the head-to-head run) and of megatok.generate.generate (with the
  cache), over training's bytes per second (forward, backward and update) of the same model.
- **generation** (``--inference``, instead of the figures above): megatok.perf.bench_inference.
- **head-to-head share**: the time HeadToHead.run takes (measured on ``--h2h-bytes`` of held-out
  text, scaled to the config's eval.heldout_max_bytes) over that plus the training time between two
  evaluations (eval.every steps of train.grad_accum micro-batches), at one rank; a baseline run,
  when one is configured, is scored too whenever its checkpoint changes (not included).

Training steps are plain torch (megatok.perf.plain_step: forward, backward, gradient clipping, AdamW
over the trainer's parameter groups; autocast bf16 and fused AdamW on a GPU), not the DeepSpeed engine:
megatok-gpu-check measures that one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatok.perf import timing
from megatok.perf.plain_step import adamw, plain_step
from megatok.perf.timing import environment, matmul_peak, summary, sync, text_documents

ROOT = Path(__file__).resolve().parents[2]

#: The shapes: --set items on top of --config (configs/tiny.json).
SHAPES = {
    "tiny": [],
    # the 1b config's proportions at a CPU's size: byte layers narrower than the main network
    "small": ["model.d_model=128", "model.n_heads=4", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
              "model.d_main=384", "model.n_main_heads=6", "model.n_main_layers=6"],
    # configs/100m.json's model at its window, 8 sequences a step (a GPU's shape)
    "100m": ["model.d_model=768", "model.n_heads=12", "model.n_encoder_layers=4", "model.n_main_layers=12",
             "model.n_decoder_layers=4", "data.seq_len=4096", "train.micro_batch_size=8"],
}
DEFAULT_SHAPES = {"cpu": ["tiny", "small"], "cuda": ["tiny", "small", "100m"]}
#: The boundary variants of every shape: --set items.
VARIANTS = {
    "policy": ["boundary.strategy=policy"],
    "fixed": ["boundary.strategy=fixed"],
    "every-byte": ["boundary.strategy=fixed", "boundary.target_rate=0.999"],  # stride round(1/0.999) = 1
    "policy-w3": ["boundary.strategy=policy", "boundary.window=3"],
}
#: With --hot-path (the default on a GPU), on the last shape: what the GPU hot path's choices cost. Each
#: is (--set items, ByteUNet attributes, megatok.model.blocks.FLEX_ATTENTION).
HOT_PATH = {
    "policy-docmask": (["boundary.strategy=policy", "model.document_mask=true"], {}, True),
    "policy-docmask-dense": (["boundary.strategy=policy", "model.document_mask=true"], {}, False),
    "policy-nosync": (["boundary.strategy=policy", "model.chunk_capacity=0.3", "model.static_chunks=true"], {}, True),
}
TARGETS = {  # (figure, comparison, value)
    "policy_share/small": ("<=", 0.02), "policy_share/tiny": ("<=", 0.02),
    "megatok_vs_every_byte/small": ("<=", 0.3),
    "data_vs_step": (">=", 20.0), "eval_vs_train": (">=", 3.0), "mfu/small": (">=", 0.5),
    "gen_b8_vs_b1/byte/tiny": (">=", 5.0), "gen_b8_vs_b1/bpe/tiny": (">=", 5.0),
    "gen_b8_vs_b1/byte/small": (">=", 5.0), "gen_b8_vs_b1/bpe/small": (">=", 5.0),
    "gen_byte_vs_bpe_b8/tiny": (">=", 0.8), "gen_byte_vs_bpe_b8/small": (">=", 1.0),
}


#: generate_batch's options for each --generation-step (megatok.generate's docstring).
GENERATION_STEPS = {"cached": {}, "static": {"static": True}, "compile": {"compile": True}}


@dataclass
class Settings:
    """What one megatok-bench invocation measures (its command line, megatok.cli.bench, in these names)."""

    config: str = str(ROOT / "configs" / "tiny.json")  # the base config
    overrides: list[str] = field(default_factory=list)  # --set items applied to every variant
    shapes: list[str] | None = None  # of SHAPES; None: DEFAULT_SHAPES for the device
    hot_path: bool | None = None  # also the HOT_PATH variants on the last shape; None: on a GPU
    device: str = "cpu"
    threads: int = 1  # CPU threads
    reps: int = 5  # rounds of the interleaved timings
    steps: int = 4  # training steps per variant per round
    eval_bytes: int = 65536  # bytes evaluate_documents scores per round
    gen_bytes: int = 128  # bytes generated per round
    h2h_bytes: int = 65536  # held-out bytes of the timed head-to-head
    matmul: int | None = None  # the matmul's size; None: 1024 on a CPU, 8192 on a GPU
    quick: bool = False  # a smoke run: at most 3 rounds of 2 steps, fewer bytes
    json_out: str | None = None  # the report as JSON, written as it grows
    budget_s: float | None = None  # start no round after this many seconds (at least one runs)
    inference: bool = False  # instead: megatok.perf.bench_inference's generation figures
    vocab: int = 4096  # --inference: the matched BPE model's vocabulary
    generation_step: str = "cached"  # --inference: generate_batch's step, "cached", "static" or "compile"
    profile: str | None = None  # instead: torch.profiler's top operators of one SHAPE/VARIANT
    estimators: str | None = None  # instead: bench_estimators' seconds per step of these methods (comma-separated)

    def __post_init__(self):
        if self.quick:
            self.reps, self.steps = min(self.reps, 3), min(self.steps, 2)
            self.eval_bytes, self.gen_bytes, self.h2h_bytes = 16384, 32, 16384
        if self.reps < 1 or self.steps < 1:
            raise ValueError("--reps and --steps must be >= 1")
        if self.generation_step not in GENERATION_STEPS:
            raise ValueError(f"--generation-step must be one of {', '.join(GENERATION_STEPS)}, got {self.generation_step!r}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


def packed(seq_len: int, rows: int) -> torch.Tensor:
    """[rows, seq_len + 1] packed byte sequences of real text."""
    from megatok.data.stream import pack_documents

    seqs = pack_documents(text_documents(rows * (seq_len + 1) + 1), seq_len)[:-1]
    return seqs.repeat(-(-rows // len(seqs)), 1)[:rows]


class Trainee:
    """One variant: its config, model, optimizer and data; ``run(n)`` times n training steps."""

    def __init__(self, name: str, cfg, device: torch.device, attrs: dict | None = None, flex: bool = True):
        from megatok.model import build_model

        self.name, self.cfg, self.device, self.flex = name, cfg, device, flex
        torch.manual_seed(cfg.train.seed)
        with torch.device(device):
            self.model = build_model(cfg).train()
        for k, v in (attrs or {}).items():
            setattr(self.model, k, v)
        t = cfg.train
        self.opt = adamw(self.model, t, device)
        self.data = packed(cfg.data.seq_len, 8 * t.micro_batch_size).view(8, t.micro_batch_size, -1)
        self.bf16 = device.type == "cuda"
        self.i = 0
        self.sums = {"chunks": 0.0, "positions": 0.0, "targets": 0.0, "steps": 0}

    def step(self) -> dict:
        from megatok.model import blocks

        blocks.FLEX_ATTENTION = self.flex
        x = self.data[self.i % len(self.data)].to(self.device, non_blocking=True)
        torch.manual_seed(self.i)
        self.i += 1
        return plain_step(self.model, self.opt, x, grad_clip=self.cfg.train.grad_clip, bf16=self.bf16).stats

    def run(self, n: int) -> float:
        """Seconds per step over n steps (the boundary statistics are read after the clock stops)."""
        sync(self.device)
        t0 = timing.now()
        stats = [self.step() for _ in range(n)]
        sync(self.device)
        dt = (timing.now() - t0) / n
        for s in stats:
            for k in ("chunks", "positions", "targets"):
                self.sums[k] += float(s.get(k, 0.0))
        self.sums["steps"] += n
        return dt

    @property
    def rate(self) -> float:
        return self.sums["chunks"] / max(1.0, self.sums["positions"])

    @property
    def bytes_per_step(self) -> float:
        """UTF-8 bytes predicted per step (targets without the document separators)."""
        return self.sums["targets"] / max(1, self.sums["steps"])


def build_shards_here(tmp: Path, n_bytes: int) -> str:
    from megatok.data.shards import build_shards

    with (tmp / "corpus.jsonl").open("w") as f:
        for d in text_documents(n_bytes):
            f.write(json.dumps({"text": d.decode("utf-8", "replace"), "lang": "en", "domain": "code"}) + "\n")
    build_shards([str(tmp / "corpus.jsonl")], str(tmp / "shards"), val_fraction=0.05, num_shards=4, progress=False)
    return str(tmp / "shards")


class NullLogger:
    def log(self, row):
        pass


def prepare(settings: Settings):
    """(settings, device, config, base) for ``settings``, the clock set: the settings with the device's
    defaults filled in, ``config(shape, variant, extra)`` a variant's config, ``base`` the first shape's policy
    config; None (the error printed) when the config does not load."""
    device = torch.device(settings.device)
    settings = replace(settings, shapes=settings.shapes or DEFAULT_SHAPES.get(device.type, DEFAULT_SHAPES["cpu"]),
                       hot_path=device.type == "cuda" if settings.hot_path is None else settings.hot_path)
    if device.type == "cpu":
        torch.set_num_threads(settings.threads)
    timing.use_clock(device, settings.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")

    from megatok.config import ConfigError, load_config

    def config(shape: str, variant: str, extra=()):
        sets = VARIANTS[variant] if variant in VARIANTS else HOT_PATH[variant][0]
        return load_config(settings.config, [*SHAPES[shape], *sets, *settings.overrides, *extra], world_size=1)

    try:
        return settings, device, config, config(settings.shapes[0], "policy")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def run(settings: Settings) -> int:
    """The benchmark (or with ``settings.profile`` the profile): prints the report, 0; 2 on a config that
    does not load."""
    prepared = prepare(settings)
    if prepared is None:
        return 2
    settings, device, config, base = prepared
    if settings.profile:
        return profile(settings, device, config)
    return Bench(settings, device, config, base).run()


def figure(figures: dict, key: str, per_round: list[float], what: str) -> None:
    """figures[key]: the summary of a figure's values over the rounds, what it is, and its target (TARGETS)
    and whether the median meets it."""
    figures[key] = {**summary(per_round), "what": what}
    if key in TARGETS:
        op, value = TARGETS[key]
        figures[key]["target"] = f"{op} {value:g}"
        figures[key]["met"] = figures[key]["median"] <= value if op == "<=" else figures[key]["median"] >= value


class Bench:
    """The timed rounds of the training variants and of the other measurements, and their report (written
    to --json-out at every stage, after every round and on SIGTERM). ``config(shape, variant, extra)``:
    a variant's config; ``base``: the first shape's policy config."""

    def __init__(self, settings: Settings, device: torch.device, config, base):
        self.settings, self.device, self.config, self.base = settings, device, config, base
        self.t_wall = time.perf_counter()
        self.report: dict = {"environment": environment(device, settings.threads), "settings": {
            k: getattr(settings, k) for k in ("config", "overrides", "shapes", "reps", "steps", "eval_bytes", "gen_bytes",
                                          "h2h_bytes", "quick")}, "figures": {}, "measured": {}}
        self.temporary: list[Path] = []
        self.rounds: list[dict[str, float]] = []

    def write(self, stage: str | None = None) -> None:
        """--json-out now: what is measured so far, and where the bench is (a run cut short keeps it)."""
        if stage:
            self.report["stage"] = stage
            print(f"bench: {stage} ({time.perf_counter() - self.t_wall:.0f} s)", file=sys.stderr, flush=True)
        if self.settings.json_out:
            Path(self.settings.json_out).write_text(json.dumps(self.report, indent=2) + "\n")

    def stop(self, signum, frame):  # `timeout`, a job's time limit: keep what was measured, then end
        self.report["stopped"] = f"SIGTERM while {self.report.get('stage', 'starting')}"
        self.write()
        for path in self.temporary:
            shutil.rmtree(path, ignore_errors=True)
        sys.exit(143)

    def run(self) -> int:
        settings, device = self.settings, self.device
        previous = signal.signal(signal.SIGTERM, self.stop)
        self.write("building the variants")
        self.trainees = self.build_trainees()
        self.tiny = self.trainees[f"{settings.shapes[0]}/policy"]
        others = self.measurements()
        # warm-up: a step of every variant (on a GPU three: compiling FlexAttention for a few chunk counts)
        self.write("warming up")
        for tr in self.trainees.values():
            tr.run(3 if device.type == "cuda" else 1)
            tr.sums = {"chunks": 0.0, "positions": 0.0, "targets": 0.0, "steps": 0}
        print(f"bench: {len(self.trainees)} variants, {settings.reps} rounds of {settings.steps} steps, device {device}, "
              f"{settings.threads if device.type == 'cpu' else '-'} thread(s)", file=sys.stderr, flush=True)
        # A round: every training variant one step at a time, in turns (so that a change of the machine's
        # load reaches them all alike), then everything else once; each round starts at another variant.
        for r in range(settings.reps):
            if settings.budget_s is not None and self.rounds and time.perf_counter() - self.t_wall > settings.budget_s:
                print(f"bench: --budget-s {settings.budget_s:g} spent: {len(self.rounds)} round(s)", file=sys.stderr,
                      flush=True)
                break
            got = dict.fromkeys(self.trainees, 0.0)
            for i in range(settings.steps):
                for name in rotated(list(self.trainees), r * settings.steps + i):
                    got[name] += self.trainees[name].run(1) / settings.steps
            for name in rotated(list(others), r):
                got[name] = others[name]()
            self.rounds.append(got)
            self.summarise()
        signal.signal(signal.SIGTERM, previous)
        print(show(self.report))
        for path in self.temporary:
            shutil.rmtree(path, ignore_errors=True)
        return 0

    def build_trainees(self) -> dict[str, "Trainee"]:
        """Every shape's variants, and with --hot-path the last shape's, with FlexAttention's check."""
        settings, config, device = self.settings, self.config, self.device
        trainees = {f"{s}/{v}": Trainee(f"{s}/{v}", config(s, v), device) for s in settings.shapes for v in VARIANTS}
        if settings.hot_path:
            s = settings.shapes[-1]
            trainees.update({f"{s}/{v}": Trainee(f"{s}/{v}", config(s, v), device, attrs, flex)
                             for v, (_, attrs, flex) in HOT_PATH.items()})
            self.report["checks"] = {"flex_attention": flex_check(trainees[f"{s}/policy-docmask"], device)}
        return trainees

    def measurements(self) -> dict:
        """{name: a function measuring it once}: the matmul's FLOP/s, one data reader's bytes/s, evaluation's
        and generation's bytes/s, and the head-to-head's seconds per byte (on the first shape's policy)."""
        settings, device, base, tiny = self.settings, self.device, self.base, self.tiny
        peak = matmul_peak(device, settings.matmul or (8192 if device.type == "cuda" else 1024))

        from megatok.data.stream import PackedByteStream, make_loader, resolve_shards
        from megatok.eval.bpb import evaluate_documents
        from megatok.eval.head_to_head import HeadToHead
        from megatok.generate import generate

        self.write("building the data, evaluation and head-to-head measurements")
        tmp = Path(tempfile.mkdtemp(prefix="megatok-bench-"))
        self.temporary.append(tmp)
        shards = build_shards_here(tmp, 2_000_000)
        stream = PackedByteStream(resolve_shards(shards, "train"), seq_len=base.data.seq_len,
                                  batch_size=base.train.micro_batch_size, seed=0)
        batches = iter(make_loader(stream, 0))
        next(batches)  # opening the first shard
        n_data = 16

        def data_rate() -> float:
            t0 = timing.now()
            n = sum(next(batches)["tokens"][:, 1:].lt(256).sum().item() for _ in range(n_data))
            return n / (timing.now() - t0)

        eval_docs = text_documents(settings.eval_bytes)
        eval_model = tiny.model

        def eval_rate() -> float:
            sync(device)
            t0 = timing.now()
            r = evaluate_documents(eval_model, iter(eval_docs_as_documents(eval_docs)), seq_len=base.data.seq_len,
                                   batch_size=base.train.micro_batch_size, mode="sample", seed=0, device=device)
            sync(device)
            eval_model.train()
            return r["bytes"] / (timing.now() - t0)

        def gen_rate(model) -> float:
            t0 = timing.now()
            g = generate(model, b"def main(", seq_len=base.data.seq_len, max_bytes=settings.gen_bytes, seed=0,
                         stop_at_separator=False, boundary_mode="threshold")
            model.train()
            return len(g.text) / (timing.now() - t0)

        # the head-to-head as the trainer runs it, on --h2h-bytes of held-out text
        heldout = tmp / "heldout.jsonl"
        with heldout.open("w") as f:
            for d in text_documents(settings.h2h_bytes):
                f.write(json.dumps({"text": d.decode("utf-8", "replace"), "lang": "en", "domain": "code"}) + "\n")
        h2h_cfg = self.config(settings.shapes[0], "policy", [f"eval.heldout={heldout}",
                                                          f"eval.heldout_max_bytes={settings.h2h_bytes}"])
        h2h = HeadToHead(h2h_cfg, 0, 1)
        h2h_bytes = sum(len(d.text) for d in h2h.docs)

        def h2h_seconds_per_byte() -> float:
            t0 = timing.now()
            h2h.run(tiny.model, 0, device, NullLogger())
            tiny.model.train()
            return (timing.now() - t0) / h2h_bytes

        return {"matmul": peak, "data": data_rate, "eval": eval_rate, "generate": lambda: gen_rate(tiny.model),
                "generate-w3": lambda: gen_rate(self.trainees[f"{settings.shapes[0]}/policy-w3"].model),
                "h2h": h2h_seconds_per_byte}

    def summarise(self) -> None:
        """The figures of the rounds so far, into the report (and --json-out: a run cut short keeps them)."""
        settings, rounds, measured = self.settings, self.rounds, self.report["measured"]
        for s in settings.shapes:
            self.shape_figures(s)
        if settings.hot_path:
            self.hot_path_figures(settings.shapes[-1])
        train_bps = self.other_figures()
        measured["matmul_flops"] = summary([g["matmul"] for g in rounds])
        measured["data_bytes_per_s"] = summary([g["data"] for g in rounds])
        measured["eval_bytes_per_s"] = summary([g["eval"] for g in rounds])
        measured["generate_bytes_per_s"] = summary([g["generate"] for g in rounds])
        measured["train_bytes_per_s"] = summary(train_bps)
        measured["h2h_s_per_mb"] = summary([g["h2h"] * 2**20 for g in rounds])
        measured["wall_s"] = time.perf_counter() - self.t_wall
        measured["rounds"] = len(rounds)
        self.write(f"round {len(rounds)} of {settings.reps} done")

    def shape_figures(self, s: str) -> None:
        """A shape's policy share, megatok against every byte and MFU, and its variants' step times."""
        from megatok.flops import flops_per_byte

        rounds, trainees, figures = self.rounds, self.trainees, self.report["figures"]
        t = {v: [g[f"{s}/{v}"] for g in rounds] for v in VARIANTS}
        figure(figures, f"policy_share/{s}", [(p - f) / p for p, f in zip(t["policy"], t["fixed"])],
               "(policy - fixed) / policy, step time")
        figure(figures, f"policy_w3_share/{s}", [(p - f) / p for p, f in zip(t["policy-w3"], t["fixed"])],
               "(policy window 3 - fixed) / policy window 3, step time")
        per_byte = {v: [x / trainees[f"{s}/{v}"].bytes_per_step for x in t[v]] for v in VARIANTS}
        figure(figures, f"megatok_vs_every_byte/{s}",
               [p / e for p, e in zip(per_byte["policy"], per_byte["every-byte"])],
               "time per byte, policy / a chunk at every byte")
        tr = trainees[f"{s}/policy"]
        fpb = flops_per_byte(tr.cfg, rate=tr.rate)["training"]
        figure(figures, f"mfu/{s}", [fpb * tr.cfg.train.micro_batch_size * tr.cfg.data.seq_len / x / g["matmul"]
                                     for x, g in zip(t["policy"], rounds)],
               f"model FLOP/s / matmul FLOP/s ({'bf16' if self.device.type == 'cuda' else 'fp32'})")
        self.report["measured"][s] = {
            v: {"step_s": summary(t[v]), "bytes_per_step": trainees[f"{s}/{v}"].bytes_per_step,
                "realised_rate": trainees[f"{s}/{v}"].rate,
                "params": sum(p.numel() for p in trainees[f"{s}/{v}"].model.parameters())} for v in VARIANTS}

    def hot_path_figures(self, s: str) -> None:
        """What document masking (FlexAttention, the dense mask) and a static chunk capacity cost at shape s."""
        figures = self.report["figures"]
        t = {v: [g[f"{s}/{v}"] for g in self.rounds] for v in ["policy", *HOT_PATH]}
        figure(figures, f"docmask_cost/{s}", [(d - p) / p for d, p in zip(t["policy-docmask"], t["policy"])],
               "(document mask - none) / none, step time, FlexAttention where usable")
        figure(figures, f"docmask_dense_cost/{s}", [(d - p) / p for d, p in zip(t["policy-docmask-dense"], t["policy"])],
               "(document mask - none) / none, step time, the dense [B, T, T] mask")
        figure(figures, f"sync_share/{s}", [(p - n) / p for p, n in zip(t["policy"], t["policy-nosync"])],
               "(K from the batch's count - K from a static chunk_capacity 0.3, no host sync) / the first, "
               "step time")
        self.report["measured"][f"{s}/hot_path"] = {v: {"step_s": summary(t[v])} for v in HOT_PATH}

    def other_figures(self) -> list[float]:
        """Data, evaluation, generation and the head-to-head against training on the first shape; returns
        training's bytes/s per round."""
        rounds, figures, s0 = self.rounds, self.report["figures"], self.settings.shapes[0]
        train_bps = [self.tiny.bytes_per_step / g[f"{s0}/policy"] for g in rounds]
        figure(figures, "data_vs_step", [g["data"] / b for g, b in zip(rounds, train_bps)],
               "one data reader's bytes/s / a training step's bytes/s (tiny shape, one rank)")
        figure(figures, "eval_vs_train", [g["eval"] / b for g, b in zip(rounds, train_bps)],
               "evaluate_documents bytes/s / training bytes/s (same model)")
        figure(figures, "generate_vs_train", [g["generate"] / b for g, b in zip(rounds, train_bps)],
               "generate (cache, window 1) bytes/s / training bytes/s (same model)")
        train_w3 = [self.trainees[f"{s0}/policy-w3"].bytes_per_step / g[f"{s0}/policy-w3"] for g in rounds]
        figure(figures, "generate_w3_vs_train", [g["generate-w3"] / b for g, b in zip(rounds, train_w3)],
               "generate (cache, policy window 3, threshold) bytes/s / training bytes/s (same model)")
        c = self.base
        accum = c.train.grad_accum or 1
        figure(figures, "h2h_share", [g["h2h"] * c.eval.heldout_max_bytes /
                                      (g["h2h"] * c.eval.heldout_max_bytes + c.eval.every * accum * g[f"{s0}/policy"])
                                      for g in rounds],
               f"head-to-head time / (it + {c.eval.every} steps x {accum} micro-batches), "
               f"{c.eval.heldout_max_bytes} held-out bytes, no baseline")
        return train_bps


def rotated(names: list[str], k: int) -> list[str]:
    return names[k % len(names):] + names[:k % len(names)]


def flex_check(tr: Trainee, device: torch.device) -> dict:
    """One forward and backward of a document-masked model with FlexAttention (where usable) and with the
    dense mask, on the same batch and boundary draws: the largest differences of the loss and gradients."""
    from megatok.model import blocks

    x = tr.data[0].to(device)
    runs = []
    usable = blocks.flex_usable(device)
    try:
        for flex in (True, False):
            blocks.FLEX_ATTENTION = flex
            tr.model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=tr.bf16):
                out = tr.model(x[:, :-1], x[:, 1:])
            out.loss.backward()
            runs.append((float(out.loss.detach()),
                         [p.grad.float().clone() for p in tr.model.parameters() if p.grad is not None]))
    finally:
        blocks.FLEX_ATTENTION = True
    tr.model.zero_grad(set_to_none=True)
    (a, ga), (b, gb) = runs
    rel = max(float((x - y).norm() / y.norm().clamp(min=1e-12)) for x, y in zip(ga, gb))
    return {"flex_usable": usable, "loss_flex": a, "loss_dense": b,
            "loss_abs_diff": abs(a - b), "grad_max_rel_diff": rel}


def eval_docs_as_documents(docs: list[bytes]):
    from megatok.data.documents import Document

    return [Document(text=d, lang=None, domain=None, source=f"stdlib#{i}") for i, d in enumerate(docs)]


def show(report: dict) -> str:
    env = report["environment"]
    lines = [f"megatok bench, {env['date']}: {env.get('gpu') or env.get('cpu')} ({env['device']}, "
             f"{env['threads']} thread(s)), torch {env['torch']}",
             "", f"{'figure':<30} {'median':>9} {'min':>9} {'max':>9}  {'target':<8} {'met':<5} what", "-" * 110]
    for key, f in report["figures"].items():
        met = "" if "met" not in f else ("yes" if f["met"] else "NO")
        lines.append(f"{key:<30} {f['median']:>9.4g} {f['min']:>9.4g} {f['max']:>9.4g}  {f.get('target', ''):<8} "
                     f"{met:<5} {f['what']}")
    lines += ["", f"{'variant':<22} {'step s (median)':>16} {'bytes/step':>11} {'rate':>7} {'params':>10}"]
    for shape, variants in report["measured"].items():
        if not isinstance(variants, dict) or "policy" not in variants:
            continue
        for v, m in variants.items():
            lines.append(f"{shape + '/' + v:<22} {m['step_s']['median']:>16.4f} {m['bytes_per_step']:>11.0f} "
                         f"{m['realised_rate']:>7.3f} {m['params']:>10,}")
    for name, check in report.get("checks", {}).items():
        lines.append(f"check {name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in check.items()))
    m = report["measured"]
    lines.append(f"\nmatmul {m['matmul_flops']['median'] / 1e9:.1f} GFLOP/s; train {m['train_bytes_per_s']['median']:,.0f}"
                 f" B/s; data {m['data_bytes_per_s']['median']:,.0f} B/s; eval {m['eval_bytes_per_s']['median']:,.0f}"
                 f" B/s; generate {m['generate_bytes_per_s']['median']:,.1f} B/s; wall {m['wall_s']:.0f} s")
    return "\n".join(lines)


def profile(settings: Settings, device: torch.device, config) -> int:
    """``--profile SHAPE/VARIANT``: --steps training steps of one variant under torch.profiler, their time by part
    (megatok.perf.step_profile) printed, with the top operators; with --json-out the table as JSON and the
    Chrome trace beside it (NAME.trace.json)."""
    from megatok.perf.step_profile import profile_steps, table

    shape, _, variant = settings.profile.partition("/")
    if shape not in SHAPES or (variant not in VARIANTS and variant not in HOT_PATH):
        print(f"error: --profile {settings.profile}: want SHAPE/VARIANT with SHAPE in {list(SHAPES)} and VARIANT in "
              f"{list(VARIANTS)}", file=sys.stderr)
        return 2
    _, attrs, flex = HOT_PATH.get(variant, (None, {}, True))
    tr = Trainee(settings.profile, config(shape, variant), device, attrs, flex)
    tr.run(1)  # warm-up, outside the profile
    batches = [tr.data[(tr.i + k) % len(tr.data)].to(device) for k in range(settings.steps)]
    trace = str(Path(settings.json_out).with_suffix(".trace.json")) if settings.json_out else None
    result = profile_steps(tr.model, tr.opt, batches, grad_clip=tr.cfg.train.grad_clip, bf16=tr.bf16, device=device,
                           trace=trace)
    result.update(profile=settings.profile, environment=environment(device, settings.threads))
    print(table(result, f"{settings.profile} on {device}"))
    if settings.json_out:
        Path(settings.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {settings.json_out} and {trace}")
    return 0

