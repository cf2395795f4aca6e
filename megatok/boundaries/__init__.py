"""Boundary strategies: one file per strategy, chosen by ``boundary.strategy``.

A strategy module ``megatok/boundaries/<name>.py`` defines two things:

- ``Options``: a pydantic model of its own config keys (they sit next to ``boundary.strategy``
  in the config and are validated against it, unknown keys rejected); a loaded config holds an
  instance of it as ``boundary.options``;
- ``Strategy``: a :class:`megatok.boundaries.base.BoundaryStrategy` subclass. Besides the layer, it
  answers what the rest of megatok asks of the strategy from the config alone (its config checks,
  parameters, FLOPs, samples per sequence, files): the functions below, which take a config's
  ``boundary`` section. Nothing outside this package reads a strategy's options by name.

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


def strategy_class(name: str):
    """The strategy's layer, a BoundaryStrategy subclass."""
    return _module(name).Strategy


def build_strategy(name: str, *, d_model: int, target_rate: float, options):
    """The strategy ``name`` with ``options``: its Options instance (a loaded config's ``boundary.options``),
    or a dict of them, validated here (tools and tests that build a strategy by hand)."""
    mod = _module(name)
    if isinstance(options, dict):
        options = mod.Options.model_validate(options)
    elif not isinstance(options, mod.Options):
        raise TypeError(f"strategy '{name}' takes its Options, not {type(options).__name__}")
    return mod.Strategy(d_model=d_model, target_rate=target_rate, options=options)


# What a config's boundary section (``strategy``, ``target_rate``, ``options``) asks of its strategy.

def check_config(cfg, world_size: int) -> None:
    """ValueError, one line, where ``cfg.boundary``'s options cannot train under ``cfg`` on ``world_size`` ranks."""
    strategy_class(cfg.boundary.strategy).check_config(cfg.boundary.options, cfg, world_size)


def param_count(boundary, d_model: int) -> int:
    """The strategy's parameters at byte width ``d_model``."""
    return strategy_class(boundary.strategy).param_count(boundary.options, d_model=d_model,
                                                         target_rate=boundary.target_rate)


def flops_per_byte(boundary, d_model: int) -> float:
    """The forward FLOPs per byte of the strategy's own layers at byte width ``d_model``."""
    return strategy_class(boundary.strategy).flops_per_byte(boundary.options, d_model=d_model,
                                                            target_rate=boundary.target_rate)


def samples_per_sequence(boundary) -> int:
    """Boundary samples per training sequence: the model runs everything after the encoder that many times."""
    return strategy_class(boundary.strategy).samples_per_sequence(boundary.options)


def model_files(boundary) -> dict[str, str]:
    """{option name: path} of the files the strategy reads besides its weights."""
    return strategy_class(boundary.strategy).model_files(boundary.options)
