"""``train.init_from``: a fresh run whose weights start from another run's checkpoint.

Not a resume: the run starts at step 0 with a new optimizer, schedule and data order; only the weights
come from the source. Every parameter whose name and shape the source has is copied; the ones it lacks
(a new boundary strategy's head) keep their initial values and the source's ones this model lacks (the
strategy it trained with) are left out, both named in one line at the start. A parameter of the same
name and another shape is a configuration mistake. A run that resumes from its own checkpoint ignores
the key (its weights are its own by then).

What it is for: handing a model over from one boundary strategy to another (for example chunks fixed at
word starts first, so that the main network learns to carry context, then the policy), or fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatok.config import Config, ConfigError
from megatok.dsconfig import builds_partitioned
from megatok.run.checkpoints import CheckpointError, checkpoint_dir
from megatok.run.reader import checkpoint_to_read, consolidated_state_dict, run_config

KEY = "train.init_from"


def source(cfg: Config) -> tuple[Path, str, Config]:
    """(run directory, checkpoint tag, the run's config) that ``train.init_from`` names: a run directory (its latest
    checkpoint) or one of its checkpoints (RUN/checkpoints/TAG). ConfigError, one line, if it names
    neither, or the model is built partitioned (ZeRO-3 with train.zero_init, where no rank holds whole
    parameters to copy into)."""
    path = Path(cfg.train.init_from)
    if builds_partitioned(cfg):
        raise ConfigError(f"{KEY}: under ZeRO-3 the weights are copied into the whole model before it is "
                          f"partitioned: set train.zero_init false")
    if path.parent.name == "checkpoints" and not (path / "checkpoints").is_dir():
        run_dir, tag = path.parent.parent, path.name
    else:
        run_dir, tag = path, None
    try:
        written = run_config(run_dir)
        tag = checkpoint_to_read(run_dir, tag)
        if not (checkpoint_dir(run_dir) / tag).is_dir():
            raise FileNotFoundError(f"{checkpoint_dir(run_dir) / tag}: checkpoint not found")
    except (FileNotFoundError, CheckpointError, ConfigError) as e:
        raise ConfigError(f"{KEY}: {e}") from None
    return run_dir, tag, written


def warm_start(model: torch.nn.Module, cfg: Config) -> str:
    """Copy the source checkpoint's weights into ``model`` (before the engine wraps it); returns the line
    that says what was copied and what was not."""
    run_dir, tag, written = source(cfg)
    try:
        weights = consolidated_state_dict(run_dir, tag, written)
    except (FileNotFoundError, CheckpointError) as e:
        raise ConfigError(f"{KEY}: {e}") from None
    own = model.state_dict()
    for name, w in weights.items():
        if name in own and own[name].shape != w.shape:
            raise ConfigError(f"{KEY}: {name} is {tuple(w.shape)} in {run_dir} ({tag}) and {tuple(own[name].shape)} "
                              f"here: the models differ in more than their boundary strategy")
    copied = [n for n in own if n in weights]
    with torch.no_grad():
        for name in copied:
            own[name].copy_(weights[name])
    kept = [n for n in own if n not in weights]
    dropped = [n for n in weights if n not in own]
    return (f"weights from {run_dir} {tag}: {len(copied)} tensors copied; initial values kept: "
            f"{', '.join(kept) or 'none'}; not in this model: {', '.join(dropped) or 'none'}")
