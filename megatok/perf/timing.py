"""What the performance measurements share: one clock, the device's sync, real text to time on, a matmul's FLOP/s
as the peak to compare with, the summary of a figure over rounds, and the environment a report records."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from megatok.metrics import cpu_name

#: The clock of every timing (:func:`use_clock`): the process's CPU time on a CPU with one thread (time
#: waiting for a core on a shared machine is not counted), else wall time (a GPU's work is not the
#: process's CPU time).
clock = time.perf_counter


def use_clock(device: torch.device, threads: int) -> None:
    """The clock for timings on ``device`` with ``threads`` CPU threads."""
    global clock
    clock = time.process_time if device.type == "cpu" and threads == 1 else time.perf_counter


def now() -> float:
    """The clock's reading, in seconds."""
    return clock()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def text_documents(limit: int) -> list[bytes]:
    """Real text on every machine: the Python standard library's sources, up to ``limit`` bytes."""
    docs, n = [], 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        d = p.read_bytes()[:40_000]
        docs.append(d)
        n += len(d)
        if n >= limit:
            break
    return docs


def matmul_peak(device: torch.device, n: int) -> callable:
    """A function timing one n x n x n matmul (fp32 on a CPU, bf16 on a GPU): FLOP/s."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    reps = 20 if device.type == "cuda" else 3

    def run() -> float:
        sync(device)
        t0 = now()
        for _ in range(reps):
            torch.mm(a, b)
        sync(device)
        return 2 * n ** 3 * reps / (now() - t0)

    run()  # warm-up
    return run


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def environment(device: torch.device, threads: int) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
           "threads": threads, "clock": "process CPU time" if clock is time.process_time else "wall",
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}  # the program's name, not its path
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env.update(cpu=cpu_name(), cores=os.cpu_count())
    return env
