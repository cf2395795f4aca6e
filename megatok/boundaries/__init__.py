"""Boundary strategies: one file per strategy, chosen by ``boundary.strategy``.

A strategy module ``megatok/boundaries/<name>.py`` defines two things:

- ``Options``: a pydantic model of its own config keys (they sit next to ``boundary.strategy``
  in the config and are validated against it, unknown keys rejected);
- ``Strategy``: a :class:`megatok.boundaries.base.BoundaryStrategy` subclass.

Adding a strategy is adding a file; nothing here lists them.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

_NOT_STRATEGIES = {"base"}


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_STRATEGIES
                  and not m.name.startswith("_"))


def _module(name: str) -> ModuleType:
    if name not in available():
        raise KeyError(f"unknown strategy '{name}' (available: {', '.join(available())})")
    return importlib.import_module(f"{__name__}.{name}")


def strategy_options(name: str):
    """The pydantic model of a strategy's options."""
    return _module(name).Options


def build_strategy(name: str, *, d_model: int, target_rate: float, options: dict):
    mod = _module(name)
    return mod.Strategy(d_model=d_model, target_rate=target_rate, options=mod.Options.model_validate(options))
