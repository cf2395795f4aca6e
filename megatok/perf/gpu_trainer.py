"""The GPU check's trainer section (megatok.perf.gpu_check): the trainer as users start it, on the device.

launch/pretrain.py on a config for a few steps under ZeRO-3 (the model built partitioned) with a checkpoint
halfway, on shards built from the Python standard library's sources, with train.deterministic; a new process
resumed from that checkpoint, whose losses must be the first run's bit for bit (else the row's error, and
megatok-gpu-check exits 1); megatok-generate on the result; then 2 steps
under ZeRO-2, whose model is built whole directly on the device. Each part is recorded as it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from megatok.config import load_config
from megatok.data.shards import build_shards
from megatok.metrics import read_metrics
from megatok.studies.launch import CHECKOUT

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A child process of its own: not this process's rank or port (the training section may have started a
    group)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run([sys.executable, *cmd], cwd=CHECKOUT, capture_output=True, text=True, timeout=timeout,
                          env={**env, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"})


def _train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("split") == "train"}


def trainer_check(config: str, overrides: list[str], *, device: torch.device, steps: int, micro: int | None,
                  timeout: float = 600, row: dict | None = None, save=lambda: None) -> dict:
    """The real trainer on the device, as users start it (launch/pretrain.py, one process): ``steps``
    steps under ZeRO-3 (the model built partitioned) with a checkpoint halfway, a new process resumed
    from that checkpoint, whose losses are compared with the first run's, megatok-generate on the
    result, then 2 steps under ZeRO-2. Data: shards built here from the Python standard library's
    sources. Each part's figures go into ``row`` (returned) as soon as it ends, and ``save()`` is
    called then, so a check cut short keeps the parts it finished; a part that would start with under
    a minute of ``timeout`` left is skipped (``skipped``)."""
    row = {} if row is None else row
    row.update(config=config, zero_stage=3, steps=steps)
    if not (CHECKOUT / "launch" / "pretrain.py").is_file():
        row["error"] = (f"no launch/pretrain.py in {CHECKOUT}: the trainer check runs the trainer of a megatok "
                        f"checkout (run this check from one)")
        return row
    tmp = Path(tempfile.mkdtemp(prefix="megatok-gpu-check-"))
    parts = _TrainerParts(config, overrides, device, steps, micro, tmp, time.monotonic() + timeout, row)
    try:
        parts.train()
        save()
        if parts.enough("resume"):
            parts.resume()
            save()
        if parts.enough("generate"):
            parts.generate()
            save()
        if parts.enough("zero2"):
            parts.zero2()
    except _Failed as e:
        row.setdefault("error", str(e))  # the first failure (a resume that was not exact) stays
    except subprocess.TimeoutExpired as e:
        row.setdefault("error", f"timed out after {e.timeout} s: {' '.join(map(str, e.cmd[1:3]))}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return row


class _Failed(Exception):
    """A part of the trainer check failed: its error ends the check."""


class _TrainerParts:
    """The parts of the trainer check, in ``tmp``, each recording into ``row``; ``end``: the monotonic
    time all their processes together must end by."""

    def __init__(self, config: str, overrides: list[str], device: torch.device, steps: int, micro: int | None,
                 tmp: Path, end: float, row: dict):
        self.config, self.overrides, self.device, self.steps, self.micro = config, overrides, device, steps, micro
        self.tmp, self.end, self.row = tmp, end, row
        self.half = steps // 2
        self.first, self.again = tmp / "run", tmp / "resumed"

    def left(self) -> float:
        return max(1.0, self.end - time.monotonic())

    def enough(self, part: str) -> bool:
        if self.end - time.monotonic() >= 60:
            return True
        self.row.setdefault("skipped", []).append(part)
        return False

    def run(self, cmd: list[str], what: str) -> subprocess.CompletedProcess:
        r = _run(cmd, self.left())
        if r.returncode:
            raise _Failed(f"{what} exited {r.returncode}: {r.stderr.strip()[-400:]}")
        return r

    def train(self) -> None:
        """``steps`` steps under ZeRO-3 with a checkpoint halfway, on shards of the standard library."""
        tmp = self.tmp
        stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        with (tmp / "corpus.jsonl").open("w") as f:
            for path in stdlib[:300]:
                f.write(json.dumps({"text": path.read_text(errors="replace")[:40_000], "lang": "en",
                                    "domain": "code"}) + "\n")
        build_shards([str(tmp / "corpus.jsonl")], str(tmp / "shards"), val_fraction=0.05, num_shards=2,
                     progress=False)
        mb = self.micro or load_config(self.config, self.overrides, world_size=1).train.micro_batch_size
        self.sets = [*self.overrides, f"data.shards={tmp / 'shards'}", "data.num_workers=1",
                     f"train.max_steps={self.steps}", f"train.save_every={self.half}", "train.log_every=1",
                     "eval.every=0", "eval.max_sequences=4", f"train.micro_batch_size={mb}", "train.grad_accum=1",
                     f"train.global_batch_size={mb}", "deepspeed.zero_optimization.stage=3",
                     "logging.wandb_mode=disabled", "logging.progress=false", "train.deterministic=true"]
        t = time.perf_counter()
        r = _run(["launch/pretrain.py", "--config", self.config, "--set", *self.sets, f"train.run_dir={self.first}"],
                 self.left())
        self.row["train_s"] = round(time.perf_counter() - t, 1)
        if r.returncode:
            raise _Failed(f"trainer exited {r.returncode}: {r.stderr.strip()[-400:]}")
        self.row["built_partitioned"] = "(built partitioned)" in r.stdout
        self.row["compiled"] = "torch.compile" in r.stdout
        self.losses = _train_losses(self.first)
        self.row.update(loss_first=round(self.losses[1], 4), loss_last=round(self.losses[self.steps], 4))

    def resume(self) -> None:
        """A new process resumed from the halfway checkpoint: its losses against the first run's."""
        tag = f"step{self.half:08d}"
        shutil.copytree(self.first / "checkpoints" / tag, self.again / "checkpoints" / tag)
        self.run(["launch/pretrain.py", "--config", str(self.first / "config.json"), "--set",
                  f"train.run_dir={self.again}", "--resume", tag], "resumed trainer")
        a, b = self.losses, _train_losses(self.again)
        diffs = [abs(b[s] - a[s]) / abs(a[s]) for s in range(self.half + 1, self.steps + 1)]
        self.row.update(resume_max_rel_diff=max(diffs), resume_exact=max(diffs) == 0.0)
        if max(diffs):  # train.deterministic asks for exactly the same losses: anything else fails the check
            self.row["error"] = (f"the resumed run's losses are not the first run's under train.deterministic (max "
                                 f"relative difference {max(diffs):.2e})")

    def generate(self) -> None:
        """megatok-generate on the trained run."""
        t = time.perf_counter()
        r = self.run(["-m", "megatok.cli.generate", "--run", str(self.first), "--prompt", "def ", "--max-bytes", "64",
                      "--device", str(self.device), "--json"], "generate")
        sample = json.loads(r.stdout.splitlines()[-1])
        self.row.update(generate_bytes=sample["bytes"], generate_s=round(time.perf_counter() - t, 1))

    def zero2(self) -> None:
        """ZeRO-2: the whole model built directly on the GPU (megatok/train/engine.py build), 2 steps."""
        t = time.perf_counter()
        self.run(["launch/pretrain.py", "--config", self.config, "--set", *self.sets,
                  "deepspeed.zero_optimization.stage=2", "train.max_steps=2", "train.save_every=2",
                  f"train.run_dir={self.tmp / 'zero2'}"], "ZeRO-2 trainer")
        z = _train_losses(self.tmp / "zero2")
        self.row.update(zero2_s=round(time.perf_counter() - t, 1), zero2_loss_first=round(z[1], 4),
                        zero2_loss_last=round(z[2], 4))


def show_trainer(report: dict) -> list[str]:
    r = report.get("trainer")
    if not r:
        return ["trainer: not run (--trainer-config none, or no DeepSpeed)"]
    parts = []
    if "train_s" in r and "loss_first" in r:
        parts.append(f"{r['steps']} steps in {r['train_s']} s (start-up included), built partitioned: "
                     f"{r['built_partitioned']}, compiled: {r['compiled']}, loss {r['loss_first']} -> {r['loss_last']}")
    if "resume_exact" in r:
        parts.append(f"resumed losses: max relative difference {r['resume_max_rel_diff']:.2e} "
                     f"({'bit-exact' if r['resume_exact'] else 'not bit-exact'})")
    if "generate_bytes" in r:
        parts.append(f"generated {r['generate_bytes']} bytes in {r['generate_s']} s (start-up included)")
    if "zero2_s" in r:
        parts.append(f"ZeRO-2 (built on the device): 2 steps in {r['zero2_s']} s, loss {r['zero2_loss_first']} -> "
                     f"{r['zero2_loss_last']}")
    if r.get("skipped"):
        parts.append(f"skipped for time: {', '.join(r['skipped'])}")
    if "error" in r:
        parts.append(f"error: {r['error']}")
    return ["trainer (launch/pretrain.py, ZeRO-3 built partitioned; resumed from the halfway checkpoint in a new "
            "process; megatok-generate on the result; 2 steps under ZeRO-2)",
            f"{r.get('config', '-')}: {'; '.join(parts) or 'nothing finished'}"]
