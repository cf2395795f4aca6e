"""megatok: byte-level language models that learn their own token boundaries.

    import megatok
    model = megatok.load("runs/my-run")     # a run directory (any checkpoint) or an export
    model.score("Hello, world").bits_per_byte

``megatok.load`` and its types live in megatok.api (docs/api.md). They are imported on first use, so that
``import megatok.config`` (every command does) does not pull in torch and the model code.
"""

import importlib
import logging

__all__ = ["load", "Model", "Score", "Completion"]


class _NoCpuFallbackWarning(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU. If you have GPU ..." warning, which every command printed on a
    machine without a GPU (the trainer's first line names the device it runs on; --device cuda without CUDA
    is an error that says why)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


logging.getLogger("DeepSpeed").addFilter(_NoCpuFallbackWarning())  # the logger DeepSpeed creates on import


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("megatok.api"), name)
    raise AttributeError(f"module 'megatok' has no attribute {name!r}")
