"""Reading checkpoint files without running code from them.

``torch.load`` with ``weights_only=False`` unpickles whatever a file names, so a downloaded run directory
could run code on the machine that evaluates or exports it. DeepSpeed's own readers (the engine's resume,
``zero_to_fp32``, the universal conversion) pass ``weights_only=False``; inside :func:`weights_only_loads`
every ``torch.load`` is made with ``weights_only=True`` and an allow-list of the few plain classes that
DeepSpeed's files hold (ALLOWED), and a file that names anything else is refused with one line.
"""

from __future__ import annotations

import contextlib
import pickle

import torch

from megatok.run.checkpoints import CheckpointError


def allowed() -> list:
    """The classes DeepSpeed 0.19's checkpoint files hold besides tensors and containers (found by loading
    ZeRO 0-3 checkpoints in fp32 and bf16: tests/run/test_safe_load.py)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads():
    """Within: every torch.load reads tensors, containers and ALLOWED only (weights_only=True, whatever the
    caller passed); a file holding another object raises CheckpointError naming the file and the object."""
    real = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return real(f, *args, **kwargs)
        except pickle.UnpicklingError as exn:
            what = next((ln.strip() for ln in str(exn).splitlines() if "Unsupported global" in ln), str(exn)[:200])
            raise CheckpointError(f"{f}: not loaded: it holds an object megatok does not load from a checkpoint, "
                                  f"since unpickling it could run code ({what.split(' was not')[0]})") from None

    with torch.serialization.safe_globals(allowed()):
        torch.load = load
        try:
            yield
        finally:
            torch.load = real
