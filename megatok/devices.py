"""The device a model is loaded on, checked before anything is read: ``megatok.load(device=...)`` and every
command's ``--device`` take cpu, cuda or cuda:N, and a device this torch cannot use is one line that says
why (a CPU build of torch, no visible GPU, an index past the last GPU) instead of torch's traceback from
inside the load.

    checked_device("cuda")   # torch.device("cuda"), or ValueError "device='cuda': this torch has no CUDA ..."
    ap.add_argument("--device", type=device_option)   # the same check as a usage error (exit 2)
"""

from __future__ import annotations

import argparse
import os

import torch


def unusable(device: torch.device | None, use: str) -> str | None:
    """Why this torch cannot run a model on ``device`` (None: not a device at all), or None when it can;
    ``use``: what to suggest instead when the GPU is what is missing."""
    if device is None or device.type not in ("cpu", "cuda"):
        return "not a device megatok runs models on (cpu, cuda or cuda:N)"
    if device.type == "cpu":
        return None
    if torch.version.cuda is None and torch.version.hip is None:
        return f"this torch has no CUDA (torch {torch.__version__}); use {use}"
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"no CUDA device is visible{f' (CUDA_VISIBLE_DEVICES={visible!r})' if visible is not None else ''}; "
                f"use {use}")
    if device.index is not None and device.index >= count:
        return f"this machine has {count} CUDA device{f's (cuda:0 to cuda:{count - 1})' if count > 1 else ' (cuda:0)'}"
    return None


def _parse(spec) -> torch.device | None:
    try:
        return torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        return None


def checked_device(spec: str | torch.device, name: str = "device") -> torch.device:
    """``spec`` as a torch.device this torch can run a model on, or a ValueError of one line naming the
    argument ``name``, its value and why: "device='cuda': this torch has no CUDA (torch 2.13.0+cpu); use
    device='cpu'"."""
    device = _parse(spec)
    why = unusable(device, use=f"{name}='cpu'")
    if why:
        raise ValueError(f"{name}={str(spec)!r}: {why}")
    return device


def device_option(text: str) -> str:
    """An argparse type for ``--device``: the checked device's name ("cpu", "cuda:1"), or why not as a
    usage error ("argument --device: cuda: this torch has no CUDA (torch 2.13.0+cpu); use --device cpu")."""
    device = _parse(text)
    why = unusable(device, use="--device cpu")
    if why:
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return str(device)


def deterministic_kernels() -> None:
    """train.deterministic: torch's deterministic kernels from here on (torch.use_deterministic_algorithms; a
    kernel with none fails with torch's error naming it), cuBLAS with a fixed workspace (CUBLAS_WORKSPACE_CONFIG,
    read when cuBLAS starts: call this before the first matmul on the GPU) and no cuDNN autotuning. On a GPU
    a resume then repeats the losses bit for bit; on a CPU they already do."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
