"""Where numbers go: RUN_DIR/metrics.jsonl (always), wandb (offline by default), the console: a
progress bar in a terminal, one line per training row in a log file.

Only rank 0 writes. wandb is optional: if it is not installed or fails to start, a warning says so
and training goes on with the JSONL file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def _clean(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


def finite_or_none(v: Any) -> Any:
    """``v`` with every NaN or infinity (nested in dicts and lists) as None: JSON files strict parsers read."""
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite_or_none(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v


def finite_number(v: Any) -> float | None:
    """``v`` as a float when it is a finite number (not a bool), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine line of a measurement."""
    import platform

    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


SHOWN = ("_bpb", "_bytes_per_chunk", "_bytes_per_token", "_bpb_gap", "cost_fraction")


def flatten(row: dict, prefix: str = "") -> dict:
    """Nested dicts (the head-to-head's by_lang / by_domain) as "by_lang/en/h2h_bpb" keys."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, enabled: bool, total_steps: int, start_step: int = 0,
                 wandb_mode: str = "offline", wandb_project: str = "megatok", wandb_entity: str | None = None,
                 wandb_name: str | None = None, config: dict | None = None, progress: bool = True,
                 wandb_group: str | None = None, wandb_tags: list[str] | None = None, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = self.tensorboard = None
        self.bar = None
        self.lines = False  # one console line per training row instead of the bar
        self.total_steps, self.start_step, self.t0 = total_steps, start_step, time.monotonic()
        if not enabled:
            return
        self.file = self.path.open("a")
        if progress:
            # disable=None: off when stderr is not a terminal, where a job's log file would get the whole
            # run on one line; it gets a line per training row instead
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            disable=None)
            self.lines = self.bar.disable
        if wandb_mode != "disabled":
            try:
                import wandb

                # quiet: wandb's where-the-run-is lines, not its history and summary block at the end (34 of
                # a 50-step run's 61 lines of output; the metrics file and megatok-summarize hold the same)
                self.wandb = wandb.init(project=wandb_project, entity=wandb_entity, name=wandb_name or Path(run_dir).name,
                                        dir=str(run_dir), mode=wandb_mode, config=config, resume="allow",
                                        group=wandb_group, tags=list(wandb_tags or []) or None,
                                        id=wandb_run_id(run_dir, wandb_name), settings=wandb.Settings(quiet=True))
            except Exception as e:  # wandb is a convenience, never a reason to stop training
                warnings.warn(f"wandb disabled: {type(e).__name__}: {e}")
        if tensorboard:  # event files under RUN_DIR/tensorboard; a resumed run's first step drops the later events
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), flush_secs=30,
                                             purge_step=start_step + 1 if start_step else None)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {k: _clean(v) for k, v in row.items()}
        row.setdefault("time", time.time())
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: name the file (a write error does not)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if self.wandb is not None or self.tensorboard is not None:
            prefix = {"val": "val/", "h2h": "h2h/"}.get(row.get("split"), "train/")
            scalars = {prefix + k: v for k, v in flatten(row).items() if isinstance(v, (int, float)) and k != "step"}
            if self.wandb is not None:
                self.wandb.log(scalars, step=row["step"])
            if self.tensorboard is not None:
                for key, value in scalars.items():
                    self.tensorboard.add_scalar(key, value, global_step=row["step"])
        if self.bar is not None and row.get("split") in ("val", "h2h"):
            self.bar.write(f"step {row['step']}: " + "  ".join(
                f"{k} {v:.4g}" for k, v in row.items() if k.endswith(SHOWN) and isinstance(v, (int, float))))

    def when(self, step: int) -> str:
        """The clock, the time this process has trained and an estimate of what is left (from its pace since
        it started: "?" before its first step), for a log line."""
        elapsed = time.monotonic() - self.t0
        done = step - self.start_step
        left = tqdm.format_interval((self.total_steps - step) * elapsed / done) if done > 0 else "?"
        return f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {tqdm.format_interval(elapsed)} elapsed, ~{left} left"

    def progress(self, step: int, **shown: float) -> None:
        """The bar's position and figures; where stdout is a log, not a terminal, the same as one line, with
        the time, the elapsed time and an estimate of the remaining (:meth:`when`)."""
        if self.lines:
            print(f"step {step}/{self.total_steps} ({self.when(step)}): "
                  + "  ".join(f"{k} {v:.4g}" for k, v in shown.items()), flush=True)
        elif self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=True)

    def close(self, failed: bool = False) -> None:
        """The metrics file, the progress bar, the wandb run (marked failed with ``failed``) and the TensorBoard
        writer; once."""
        if not self.enabled or self.file.closed:
            return
        try:
            if self.bar is not None:
                self.bar.close()
            if self.wandb is not None:
                self.wandb.finish(exit_code=1 if failed else None)
            if self.tensorboard is not None:
                self.tensorboard.close()
        finally:
            self.file.close()


def wandb_run_id(run_dir, name: str | None) -> str:
    """Stable across resumes of one run directory, distinct for two directories with the same name. The
    characters wandb refuses in an id (a sweep's "lr:1e-3") become '-' (the id only; the name is kept)."""
    path = str(Path(run_dir).resolve())
    readable = re.sub(r"[:;,#?/'\\]", "-", name or Path(path).name)
    return f"{readable}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl. A last line cut short (the run was killed, or the disk filled,
    while writing it) is left out with a warning; the trainer drops it when the run resumes."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n < len(lines):
                raise ValueError(f"{path}:{i}: not a JSON row ({e})") from None
            warnings.warn(f"{path}:{i}: the last row was cut short (the run was killed or the disk filled while "
                          f"writing it); left out", stacklevel=2)
    return rows
