"""Fault injection for the reliability tests: callbacks that tests/train/faulty_pretrain.py installs in
the Trainer, chosen by environment variables:

    MEGATOK_FAULT_NAN_STEPS=3,4       this rank's loss becomes NaN at these optimizer steps (1-based)
    MEGATOK_FAULT_NAN_RANK=0          ...only on this rank (default: every rank)
    MEGATOK_FAULT_DIE_IN_SAVE=6       rank 0 SIGKILLs itself while the step-6 checkpoint is half written
                                      (every rank's files written, nothing published)
    MEGATOK_FAULT_HANG=1:3            rank 1 stops responding (sleeps) at step 3
    MEGATOK_FAULT_SLOW_SAVE=4:20      rank 0 takes 20 s longer to write the step-4 checkpoint (the
                                      other ranks wait for it in the save's barrier)
    MEGATOK_FAULT_OOM=0:2             rank 0 raises torch.OutOfMemoryError at step 2 (as a GPU would)
    MEGATOK_FAULT_STEP_SLEEP=0.3      every rank sleeps 0.3 s at the start of every step (a slower model:
                                      the same losses, more time to act in the middle of a run)
    MEGATOK_FAULT_DIE_AT=1:5          rank 1 SIGKILLs itself at the start of step 5 ("all:5": every rank)
    MEGATOK_FAULT_DIE_BEFORE_LATEST=8 rank 0 SIGKILLs itself when the step-8 checkpoint is renamed into
                                      place and ``latest`` does not name it yet
    MEGATOK_FAULT_STOP_AT=6           rank 0 touches RUN_DIR/STOP at the start of step 6 (the run saves and
                                      ends cleanly after it)

The faults inside a save wrap functions of megatok.train.checkpointer for the process they run in.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from megatok.train import checkpointer
from megatok.train.callbacks import Callback


def _rank_step(name: str) -> tuple[int, int] | None:
    spec = os.environ.get(name)
    return tuple(map(int, spec.split(":"))) if spec else None


class NanLoss(Callback):
    """The engine's forward gives a NaN loss at ``steps`` on ``rank`` (None: every rank)."""

    def __init__(self, steps: set[int], rank: int | None):
        self.steps, self.rank = steps, rank

    def on_fit_start(self, trainer):
        if self.rank not in (None, trainer.rank):
            return
        forward = trainer.engine.forward

        def nan_forward(tokens):
            out = forward(tokens)
            if trainer.step + 1 in self.steps:
                out.loss = out.loss * float("nan")
            return out

        trainer.engine.forward = nan_forward


class AtStepBegin(Callback):
    """``act()`` on ``rank`` at the beginning of optimizer step ``step``."""

    def __init__(self, rank: int, step: int, act):
        self.rank, self.step, self.act = rank, step, act

    def on_step_begin(self, trainer):
        if (trainer.rank, trainer.step + 1) == (self.rank, self.step):
            self.act()


class EveryStep(Callback):
    """``act()`` on every rank at the beginning of every optimizer step."""

    def __init__(self, act):
        self.act = act

    def on_step_begin(self, trainer):
        self.act()


def _out_of_memory():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


class InSave(Callback):
    """Wraps ``checkpointer.<name>`` so that on rank 0, while the step-``step`` checkpoint is saved, ``act()``
    runs first. rng_state: every rank writes its generators before the save's barrier; _publish: rank 0
    publishes after every rank has written its files."""

    def __init__(self, name: str, step: int, act):
        self.name, self.step, self.act = name, step, act

    def on_fit_start(self, trainer):
        original = getattr(checkpointer, self.name)

        def wrapped(*args, **kwargs):
            if trainer.rank == 0 and trainer.step == self.step:
                self.act()
            return original(*args, **kwargs)

        setattr(checkpointer, self.name, wrapped)


def from_env() -> list[Callback]:
    """The fault callbacks the MEGATOK_FAULT_* variables ask for."""
    out = []
    if steps := {int(v) for v in os.environ.get("MEGATOK_FAULT_NAN_STEPS", "").split(",") if v.strip()}:
        rank = os.environ.get("MEGATOK_FAULT_NAN_RANK")
        out.append(NanLoss(steps, None if rank is None else int(rank)))
    if at := _rank_step("MEGATOK_FAULT_HANG"):
        out.append(AtStepBegin(*at, lambda: time.sleep(3600)))
    if seconds := os.environ.get("MEGATOK_FAULT_STEP_SLEEP"):
        out.append(EveryStep(lambda: time.sleep(float(seconds))))
    if at := _rank_step("MEGATOK_FAULT_OOM"):
        out.append(AtStepBegin(*at, _out_of_memory))
    if spec := os.environ.get("MEGATOK_FAULT_SLOW_SAVE"):
        step, seconds = spec.split(":")
        out.append(InSave("rng_state", int(step), lambda: time.sleep(float(seconds))))
    if step := os.environ.get("MEGATOK_FAULT_DIE_IN_SAVE"):
        out.append(InSave("_publish", int(step), lambda: os.kill(os.getpid(), signal.SIGKILL)))
    if step := os.environ.get("MEGATOK_FAULT_DIE_BEFORE_LATEST"):
        out.append(InSave("set_latest", int(step), lambda: os.kill(os.getpid(), signal.SIGKILL)))
    if spec := os.environ.get("MEGATOK_FAULT_DIE_AT"):
        who, step = spec.split(":")
        out.append(DieAt(None if who == "all" else int(who), int(step)))
    if step := os.environ.get("MEGATOK_FAULT_STOP_AT"):
        out.append(StopAt(int(step)))
    return out


class DieAt(Callback):
    """SIGKILL of ``rank`` (None: every rank) at the beginning of optimizer step ``step``."""

    def __init__(self, rank: int | None, step: int):
        self.rank, self.step = rank, step

    def on_step_begin(self, trainer):
        if trainer.step + 1 == self.step and self.rank in (None, trainer.rank):
            os.kill(os.getpid(), signal.SIGKILL)


class StopAt(Callback):
    """Rank 0 touches RUN_DIR/STOP at the beginning of optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, trainer):
        if trainer.rank == 0 and trainer.step + 1 == self.step:
            (trainer.checkpointer.run_dir / "STOP").touch()
