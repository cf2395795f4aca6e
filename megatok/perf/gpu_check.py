"""Check one GPU (H100/H200) before a cluster run: the trainer, generation's step modes, bf16 training speed,
MFU, memory, attention backends.

    megatok-gpu-check                       # on the GPU machine: a few minutes, no network, installs nothing
    megatok-gpu-check --configs configs/100m.json configs/1b.json --steps 10 --json-out docs/gpu_check.json
    megatok-gpu-check --cpu-smoke           # the same code paths on a CPU with a tiny config (the tests)

On a bare GPU machine (an image with torch and nothing else: carry the checkout and the wheels of
tools/gpu_wheels.sh there, installed with ``pip install --no-index --no-deps --target "$SITE"`` into a directory
of your own, ``SITE=$(mktemp -d)``), run it from the checkout without installing megatok:

    PYTHONPATH=$SITE:$PWD python3 -m megatok.cli.gpu_check --json-out gpu_check.json

It runs four sections, by default in this order (--sections picks and orders them), and prints each:

1. trainer: the trainer as users start it (with DeepSpeed): launch/pretrain.py on --trainer-config
   (default 100m, compiled as its config says) for --trainer-steps steps under ZeRO-3 (the model built
   partitioned), on shards built from the standard library's sources; a new process resumed from the
   halfway checkpoint, whose losses must be the first run's bit for bit (the runs use train.deterministic;
   a resume that is not exact is the section's error); megatok-generate on the result; then 2 steps under
   ZeRO-2, whose model is built whole directly on the GPU. Each part is recorded as it ends
   (megatok/perf/gpu_trainer.py).
2. generation: megatok.generate.generate_batch on a small byte model and a small BPE token model
   (untrained, fp32) at batch 1 and 8, prompts of different lengths, in its three step modes: the
   default cached step, the static step (fixed shapes, no host read) and that step as a CUDA graph
   (not in --cpu-smoke: a GPU only); each mode's texts against the default's (identical rows, the share of
   identical bytes, the largest log-probability difference) and each mode's bytes/s, --gen-bytes bytes a
   row (megatok/perf/gpu_generation.py). Each model and batch is recorded as it ends.
3. training: for each config (default 100m and 1b): bf16 training steps on one GPU, one micro-batch per
   step (train.micro_batch_size, or --micro), on real text (the Python standard library's sources, on
   every machine): bytes/s, model FLOPs per byte at the realised boundary rate (megatok/flops.py,
   training = 3 x forward), MFU = achieved FLOP/s / the dense bf16 peak of the device (H100/H200: 989
   TFLOP/s, detected from the device name; --peak-tflops overrides), peak memory against megatok.flops'
   estimate for one rank. The engine is DeepSpeed (the config's ZeRO stage and bf16, as the trainer
   runs it) when importable, else a plain torch loop (autocast bf16, fp32 weights, fused AdamW);
   --engine picks one. Then the first config once more with model.document_mask (attention through
   FlexAttention's block mask): its cost in bytes/s and memory; and once more with train.compile the
   other way (the GPU configs compile; the untimed warm-up steps compile): what compiling the blocks
   gains (not in --cpu-smoke unless --compile is given); and once more with train.deterministic: what
   deterministic kernels cost (likewise, --deterministic). Each row in a spawned process of its own
   (megatok/perf/gpu_training.py).
4. attention: flash-attn against torch SDPA (if flash_attn is importable): largest difference of
   outputs and input gradients on the same bf16 inputs, and forward+backward time of each, at
   megatok's byte-rate shape (T = seq_len) and main-network shape (T = rho x seq_len). Without
   flash-attn: SDPA timings only.

The report (stdout, --json-out) is written after every part and when SIGTERM ends the check.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatok import flops, sizing
from megatok.config import ConfigError, load_config
from megatok.model import blocks
from megatok.perf.timing import sync
from megatok.perf.gpu_generation import generation_check, show_generation
from megatok.perf.gpu_trainer import show_trainer, trainer_check
from megatok.perf.gpu_training import GIB, isolated_train_check, show_training
from megatok.train import dist

#: The generation section's byte model (its BPE model: the same widths; megatok.perf.gpu_generation).
GENERATION_CONFIG = "configs/tiny.json"
SMOKE_SETS = ["model.d_model=64", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_main_layers=2",
              "model.n_decoder_layers=1", "data.seq_len=128", "deepspeed.bf16.enabled=false",
              "deepspeed.zero_optimization.stage=1"]


#: The sections, in the order they run by default: the trainer (does megatok train, resume and generate
#: on this GPU at all) first, then generation's step modes (short: its CUDA graph runs nowhere else), then
#: the training figures (MFU, bytes/s, memory), then attention backends.
SECTIONS = ("trainer", "generation", "training", "attention")
#: The training section's configs on a GPU unless --configs names others.
GPU_CONFIGS = ("configs/100m.json", "configs/1b.json")
#: The trainer section's config on a GPU unless --trainer-config names another.
TRAINER_CONFIG = "configs/100m.json"


@dataclass
class Settings:
    """What one megatok-gpu-check invocation runs (its command line, megatok.cli.gpu_check, in these names)."""

    configs: list[str] | None = None  # the training section's configs (None: GPU_CONFIGS; not with cpu_smoke)
    overrides: list[str] = field(default_factory=list)  # --set items applied to every config
    steps: int = 10  # timed steps per config
    warmup: int = 3  # untimed steps first
    micro: int | None = None  # the micro-batch (None: the config's)
    engine: str = "auto"  # "auto", "deepspeed" or "torch"
    peak_tflops: float | None = None  # the device's dense bf16 peak (None: by its name)
    attn_iters: int = 20
    json_out: str | None = None  # the report as JSON, written after every part
    trainer_config: str | None = None  # the trainer section's config (None: TRAINER_CONFIG; "none" skips it)
    trainer_steps: int = 6  # steps of the trainer check (even)
    gen_bytes: int = 128  # bytes each row generates in the generation section
    document_mask: bool = True  # the first config's second run with model.document_mask
    compile: bool | None = None  # the first config once more with train.compile the other way (None: on a GPU)
    deterministic: bool | None = None  # the first config once more with train.deterministic (None: on a GPU)
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))  # what to run, in this order
    cpu_smoke: bool = False  # the tiny config on the CPU, 2 steps: the code paths
    budget_s: float = 480  # wall-clock budget (work that would start past it is skipped and reported)

    def __post_init__(self):
        for option, given in (("--configs", self.configs is not None),
                              ("--trainer-config", self.trainer_config not in (None, "none"))):
            if self.cpu_smoke and given:
                raise ValueError(f"{option} is for the GPU run; --cpu-smoke runs configs/tiny.json, shrunk: give one "
                                 f"or the other (--trainer-config none still skips the trainer section)")
        if self.steps < 1 or self.attn_iters < 1 or self.warmup < 0:
            raise ValueError(f"--steps and --attn-iters must be >= 1 and --warmup >= 0, got {self.steps}, "
                             f"{self.attn_iters} and {self.warmup}")


# ----------------------------------------------------------------------------- helpers

def peak_tflops(device: torch.device, override: float | None) -> float | None:
    return override or flops.device_peak_tflops(device)


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / GIB, 1))
    for mod in ("deepspeed", "flash_attn"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: report, do not fail
            env[mod] = None
    return env


# ----------------------------------------------------------------------------- attention

def attention_check(device: torch.device, shapes: list[tuple[int, int, int, int]], iters: int) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    have_flash = blocks.flash_attn_func is not None and device.type == "cuda"
    rows = []
    for B, H, T, D in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g) for _ in range(3))
        dout = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g)
        row = {"shape": [B, H, T, D], "dtype": str(dtype).replace("torch.", "")}
        results = {}
        for backend in (["flash_attn"] if have_flash else []) + ["sdpa"]:
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = blocks.attention(qq, kk, vv, backend=backend)
            out.backward(dout)
            results[backend] = (out.detach().float(), qq.grad.float(), kk.grad.float(), vv.grad.float())
            for _ in range(2):  # warm-up
                blocks.attention(qq, kk, vv, backend=backend).backward(dout)
            sync(device)
            t = time.perf_counter()
            for _ in range(iters):
                blocks.attention(qq, kk, vv, backend=backend).backward(dout)
            sync(device)
            ms = (time.perf_counter() - t) / iters * 1e3
            causal_flops = 3 * 2 * 2 * B * H * D * T * (T + 1) / 2  # fwd + bwd (3x), QK^T and AV, causal half
            row[f"{backend}_ms"] = round(ms, 3)
            row[f"{backend}_tflops"] = round(causal_flops / (ms / 1e3) / 1e12, 2)
        if have_flash:
            a, b = results["flash_attn"], results["sdpa"]
            row["max_abs_diff"] = {n: float((x - y).abs().max()) for n, x, y in zip(("out", "dq", "dk", "dv"), a, b)}
            scale = max(float(b[0].abs().max()), 1e-6)
            row["equal"] = row["max_abs_diff"]["out"] <= 2e-2 * scale  # bf16 has ~3 significant digits
        else:
            row["note"] = "flash_attn not importable (or not on a GPU): SDPA only"
        rows.append(row)
        del q, k, v, dout, results
    return rows


# ----------------------------------------------------------------------------- report

def show(report: dict) -> str:
    """The report as text: its sections in the order they ran."""
    lines = ["environment: " + ", ".join(f"{k}={v}" for k, v in report["environment"].items())]
    shown = {"trainer": show_trainer, "generation": show_generation, "training": show_training,
             "attention": _show_attention}
    for name in report.get("sections", SECTIONS):
        lines += ["", *shown[name](report)]
    if report.get("stopped"):
        lines += ["", f"stopped early: {report['stopped']} (what is above was measured before)"]
    return "\n".join(lines)


def _show_attention(report: dict) -> list[str]:
    lines = ["attention: flash-attn vs SDPA (forward + backward)",
             "| B,H,T,D | flash ms | SDPA ms | flash TFLOP/s | SDPA TFLOP/s | equal | max |out diff| |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in report["attention"]:
        if "error" in r:
            lines.append(f"| error: {r['error']} |")
            continue
        lines.append(f"| {','.join(map(str, r['shape']))} | {r.get('flash_attn_ms', '-')} | {r['sdpa_ms']} | "
                     f"{r.get('flash_attn_tflops', '-')} | {r['sdpa_tflops']} | {r.get('equal', 'n/a')} | "
                     f"{r.get('max_abs_diff', {}).get('out', '-')} |")
        if "note" in r:
            lines.append(f"  ({r['note']})")
    return lines


def run(settings: Settings) -> int:
    """The check with ``settings``: its sections in the order asked, the report printed (and written to
    --json-out) after every part, and on SIGTERM; 0, or 1 when the trainer section failed (a resume that was not
    bit-exact included; not when it was skipped or ran out of time), or 2 without a CUDA device (unless
    --cpu-smoke) or for a config (with the --set items) that cannot be loaded, before any section runs."""
    deadline = time.monotonic() + settings.budget_s
    os.environ.setdefault("WANDB_MODE", "disabled")
    if not settings.cpu_smoke and os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":  # before DeepSpeed reads it
        print(f"gpu_check: DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} ignored: the GPU check runs DeepSpeed on "
              f"cuda", file=sys.stderr)
        os.environ["DS_ACCELERATOR"] = "cuda"  # the trainer processes it starts inherit it too
    if _importable("deepspeed"):
        sizing.quiet_deepspeed_import()
    if not settings.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device (use --cpu-smoke to test the script on a CPU)", file=sys.stderr)
        return 2
    check = Check(settings, deadline)
    try:  # a mistake in a config or --set costs no GPU time: the sections report errors and go on
        check.check_configs()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def stop(signum, frame):
        check.report["stopped"] = "SIGTERM"
        sys.exit(143)

    sections = {"trainer": check.trainer_section, "generation": check.generation_section,
                "training": check.training_section, "attention": check.attention_section}
    previous = signal.signal(signal.SIGTERM, stop)  # e.g. `timeout`: the finally still reports
    try:
        for name in settings.sections:
            sections[name]()
    finally:  # whatever ended the check (an error, SIGTERM): the report of what was measured
        signal.signal(signal.SIGTERM, previous)
        print(show(check.report), flush=True)
        check.write()
    try:
        dist.finish()
    except Exception:  # noqa: BLE001 - no process group was started
        pass
    error = check.report.get("trainer", {}).get("error", "")
    return 1 if error and not error.startswith(("skipped", "timed out")) else 0  # failed, or resumed inexactly


class Check:
    """One check's settings (from ``settings``: --cpu-smoke's tiny config on the CPU, else the GPU's), its
    report and its ``deadline`` (monotonic time: --budget-s from the start)."""

    def __init__(self, settings: Settings, deadline: float):
        self.settings, self.deadline = settings, deadline
        if settings.cpu_smoke:
            self.device = torch.device("cpu")
            self.configs, self.overrides = ["configs/tiny.json"], SMOKE_SETS + settings.overrides
            self.steps, self.warmup, self.micro = min(settings.steps, 2), min(settings.warmup, 1), settings.micro or 2
            self.trainer_config = None if settings.trainer_config == "none" else "configs/tiny.json"
            self.trainer_steps = 2
            self.shapes = [(1, 2, 128, 32), (1, 2, 32, 32)]
            self.gen_bytes = min(settings.gen_bytes, 16)
        else:
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            self.configs = list(GPU_CONFIGS if settings.configs is None else settings.configs)
            self.overrides = settings.overrides
            self.steps, self.warmup, self.micro = settings.steps, settings.warmup, settings.micro
            self.trainer_config = {"none": None, None: TRAINER_CONFIG}.get(settings.trainer_config,
                                                                             settings.trainer_config)
            self.trainer_steps = settings.trainer_steps
            self.shapes = [(8, 16, 4096, 64), (8, 16, 820, 128)]  # byte rate at seq_len 4096; main rate at rho = 0.2
            self.gen_bytes = settings.gen_bytes
        self.engine = settings.engine
        if self.engine == "auto":
            self.engine = "deepspeed" if _importable("deepspeed") else "torch"
        self.peak = peak_tflops(self.device, settings.peak_tflops)
        self.report = {"environment": environment(self.device), "sections": settings.sections, "attention": [],
                       "training": [], "generation": []}

    def check_configs(self) -> None:
        """Every config the asked sections read, with the overrides, loaded: ConfigError for the first that
        cannot be."""
        used = {"trainer": [self.trainer_config] if self.trainer_config else [], "generation": [GENERATION_CONFIG],
                "training": self.configs, "attention": []}
        for config in dict.fromkeys(c for name in self.settings.sections for c in used[name]):
            load_config(config, self.overrides, world_size=1)

    def write(self) -> None:
        if self.settings.json_out:
            Path(self.settings.json_out).write_text(json.dumps(self.report, indent=2) + "\n")

    def save(self, done: str) -> None:  # after every part: a run cut short keeps what it measured
        print(f"gpu_check: {done} ({time.monotonic() - self.deadline + self.settings.budget_s:.0f} s)", flush=True)
        self.write()

    def trainer_section(self) -> None:
        if not self.trainer_config or self.engine != "deepspeed":
            return
        left = self.deadline - time.monotonic()
        if left < 60:
            self.report["trainer"] = {"config": self.trainer_config,
                                      "error": f"skipped: --budget-s spent ({left:.0f} s left)"}
        else:
            row = self.report["trainer"] = {}
            try:
                trainer_check(str(Path(self.trainer_config).absolute()), self.overrides, device=self.device,
                              steps=max(2, self.trainer_steps // 2 * 2), micro=self.micro, timeout=left, row=row,
                              save=lambda: self.save("trainer part done"))
            except Exception as e:  # noqa: BLE001 - what it finished is kept
                traceback.print_exc()
                row.setdefault("error", f"{type(e).__name__}: {e}"[:300])  # an inexact resume before it stays
            row["config"] = self.trainer_config
        self.save("trainer done")

    def training_section(self) -> None:
        configs, overrides = self.configs, self.overrides
        runs = [(config, overrides, config) for config in configs]
        if self.settings.document_mask and configs:
            runs.append((configs[0], overrides + ["model.document_mask=true"], f"{configs[0]} + document_mask"))
        if (self.settings.compile if self.settings.compile is not None else not self.settings.cpu_smoke) and configs:
            compiled = load_config(configs[0], overrides, world_size=1).train.compile
            runs.append((configs[0], overrides + [f"train.compile={str(not compiled).lower()}"],
                         f"{configs[0]} {'- compile' if compiled else '+ compile'}"))
        if (self.settings.deterministic if self.settings.deterministic is not None else not self.settings.cpu_smoke) \
                and configs:  # what bit-exact resumes cost
            runs.append((configs[0], overrides + ["train.deterministic=true"], f"{configs[0]} + deterministic"))
        for config, sets, label in runs:
            self.save(f"training {label} done" if self.run_training(config, sets, label) else f"training {label} skipped")

    def run_training(self, config: str, sets: list[str], label: str) -> bool:
        rows = self.report["training"]
        if time.monotonic() > self.deadline:
            rows.append({"config": label, "engine": self.engine, "error": "skipped: --budget-s spent"})
            return False
        try:
            rows.append(isolated_train_check(self.deadline - time.monotonic(), config, sets, device=self.device,
                                             engine=self.engine, steps=self.steps, warmup=self.warmup,
                                             micro=self.micro, peak=self.peak))
            rows[-1]["config"] = label
        except torch.cuda.OutOfMemoryError as e:  # report and go on with the next config
            rows.append({"config": label, "engine": self.engine, "error": f"out of memory: {e}"[:300]})
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - one failing run must not cost the rest of the check
            traceback.print_exc()
            rows.append({"config": label, "engine": self.engine, "error": f"{type(e).__name__}: {e}"[:300]})
        return True

    def generation_section(self) -> None:
        rows = self.report["generation"]
        if time.monotonic() > self.deadline:
            rows.append({"error": "skipped: --budget-s spent"})
        else:
            try:
                generation_check(self.device, GENERATION_CONFIG, self.overrides, max_bytes=self.gen_bytes,
                                 deadline=self.deadline, rows=rows, save=self.save)
            except Exception as e:  # noqa: BLE001 - what it finished is kept
                traceback.print_exc()
                rows.append({"error": f"{type(e).__name__}: {e}"[:300]})
        self.save("generation done")

    def attention_section(self) -> None:
        if time.monotonic() > self.deadline:
            self.report["attention"] = [{"error": "skipped: --budget-s spent"}]
        else:
            self.report["attention"] = attention_check(self.device, self.shapes, self.settings.attn_iters)
        self.save("attention done")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
