"""Where the studies train: launch/pretrain.py of the checkout this package is in, as users start it; and
whether a run has finished."""

from __future__ import annotations

import sys
from pathlib import Path

from megatok.metrics import read_metrics
from megatok.train.dist import free_port

#: The checkout this module is in: the studies start its launch/pretrain.py, as users do.
CHECKOUT = Path(__file__).resolve().parents[2]


def finished(run: dict) -> bool:
    """Whether ``run`` ({"run_dir", "max_steps", ...}) has its final validation row."""
    p = Path(run["run_dir"]) / "metrics.jsonl"
    return p.is_file() and any(r.get("split") == "val" and r.get("step") == run["max_steps"]
                               for r in read_metrics(run["run_dir"]))


def local_command(run: dict, nproc: int) -> list[str]:
    """The command that trains ``run``'s config here on ``nproc`` ranks (``deepspeed --num_gpus`` for more
    than one, else one process)."""
    script = [str(CHECKOUT / "launch/pretrain.py"), "--config", run["config"]]
    if nproc > 1:
        return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc),
                "--master_port", str(free_port())] + script
    return [sys.executable] + script
