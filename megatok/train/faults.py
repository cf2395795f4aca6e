"""Fault injection for the reliability tests, driven by environment variables (all unset in real runs).

    MEGATOK_FAULT_NAN_STEPS=3,4       this rank's loss becomes NaN at these optimizer steps (1-based)
    MEGATOK_FAULT_NAN_RANK=0          ...only on this rank (default: every rank)
    MEGATOK_FAULT_DIE_IN_SAVE=6       SIGKILL this process while the step-6 checkpoint is half written
    MEGATOK_FAULT_HANG=1:3            rank 1 stops responding (sleeps) at step 3
    MEGATOK_FAULT_SLOW_SAVE=4:20      rank 0 takes 20 s longer to write the step-4 checkpoint
    MEGATOK_FAULT_OOM=0:2             rank 0 raises torch.OutOfMemoryError at step 2 (as a GPU would)
"""

from __future__ import annotations

import os
import signal
import time


def _ints(name: str) -> set[int]:
    return {int(v) for v in os.environ.get(name, "").split(",") if v.strip()}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def nan_loss(step: int) -> bool:
    rank = os.environ.get("MEGATOK_FAULT_NAN_RANK")
    return step in _ints("MEGATOK_FAULT_NAN_STEPS") and (rank is None or int(rank) == _rank())


def maybe_die_in_save(step: int) -> None:
    if step in _ints("MEGATOK_FAULT_DIE_IN_SAVE") and _rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_hang(step: int) -> None:
    spec = os.environ.get("MEGATOK_FAULT_HANG")
    if spec and tuple(map(int, spec.split(":"))) == (_rank(), step):
        time.sleep(3600)


def maybe_slow_save(step: int) -> None:
    spec = os.environ.get("MEGATOK_FAULT_SLOW_SAVE")
    if spec and _rank() == 0 and int(spec.split(":")[0]) == step:
        time.sleep(float(spec.split(":")[1]))


def maybe_oom(step: int) -> None:
    spec = os.environ.get("MEGATOK_FAULT_OOM")
    if spec and tuple(map(int, spec.split(":"))) == (_rank(), step):
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
