"""The trainer's side duties, as callbacks: the watchdog, stop requests, the profiler window, the
metrics rows and the console (evaluation: megatok.train.evaluation.Evaluation). Each hook gets the
Trainer; extra callbacks (``Trainer(callbacks=...)``) run after these, in order."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatok.run.checkpoints import tag_for
from megatok.train import dist, peers

if TYPE_CHECKING:
    from megatok.train.trainer import Trainer


class Callback:
    """Hooks the trainer calls; each does nothing unless overridden. A callback with state (the
    evaluation's) names its part of a checkpoint's megatok.json in ``state_key``: the trainer saves its
    ``state_dict()`` there and, resuming, gives that part back to its ``load_state_dict()``."""

    state_key: str | None = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """``state``: what :meth:`state_dict` returned when the checkpoint was saved."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step (the components are built and resumed)."""

    def on_step_begin(self, trainer: Trainer) -> None:
        """Before optimizer step ``trainer.step + 1``."""

    def on_step_end(self, trainer: Trainer) -> None:
        """After optimizer step ``trainer.step``, once the ranks have agreed whether to stop
        (``trainer.stopping``); before its checkpoint, if one is due."""

    def on_progress(self, trainer: Trainer, doing: str, limit: tuple[float, str] | None) -> None:
        """The trainer is about to do ``doing``, which may take ``limit`` (seconds, config key) if not None."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """After the last step (and its checkpoint), before the trainer closes its components."""

    def on_fit_error(self, trainer: Trainer, error: BaseException) -> None:
        """fit() raised ``error`` (in a step, a save or a hook, on_fit_end included): release what the
        callback holds (a thread, signal handlers, a profiler). The trainer then closes its data stream and
        logger and re-raises ``error``; what this raises is noted on ``error``, and the other callbacks'
        on_fit_error still run."""

    def stop_requested(self, trainer: Trainer) -> bool:
        """Whether this rank asks the run to checkpoint and stop after the current step."""
        return False


class Watchdog(Callback):
    """Ends this rank when the trainer makes no progress for train.dist_timeout_s (a checkpoint save:
    train.save_timeout_s): megatok.train.dist.Watchdog, beaten at every step, evaluation and save."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.dog = timeout_s, None

    def on_fit_start(self, trainer):
        self.dog = dist.Watchdog(self.timeout_s, lambda: self.describe(trainer))

    @staticmethod
    def describe(trainer) -> str:
        """The end of the line the watchdog prints: which rank is gone (megatok.train.peers), the last
        good checkpoint."""
        peers.last_words()
        lost = peers.lost()
        return f"{lost + '; ' if lost else ''}last good checkpoint: {trainer.checkpointer.last_good()}"

    def on_step_begin(self, trainer):
        self.dog.beat(f"training step {trainer.step + 1}")

    def on_progress(self, trainer, doing, limit):
        self.dog.beat(doing, limit)

    def on_fit_end(self, trainer):
        self.dog.stop()

    def on_fit_error(self, trainer, error):
        if self.dog is not None:  # else it would end the process train.dist_timeout_s later
            self.dog.stop()


def _started() -> float:
    """When this run started: when this process imported the trainer (before it built anything), or the
    job's start where the launcher recorded it earlier (MEGATOK_JOB_STARTED, seconds since the epoch: the
    Slurm template's trap may touch the stop file before the trainer is up). A stop file touched since counts."""
    now = time.time()
    try:
        job = float(os.environ.get("MEGATOK_JOB_STARTED", "nan"))
    except ValueError:
        return now
    return job if math.isfinite(job) and job <= now else now


STARTED = _started()


class StopRequest(Callback):
    """SIGTERM/SIGINT (a scheduler's pre-emption, Ctrl-C), or a file RUN_DIR/STOP (or the file the
    environment variable MEGATOK_STOP_FILE names: the Slurm template's time-limit trap touches it),
    asks for a checkpoint and a clean exit at the end of the current step. Ranks may see the request
    at different times; the trainer agrees on stopping through a collective, so every rank stops at the
    same step and the checkpoint is complete. The file works with any launcher and from any machine
    that sees it; rank 0 alone looks for it (the collective tells the others) and removes it once the
    run has stopped. The handlers are installed when the fit starts (a Trainer built and not fitted leaves
    them alone) and restored at its end, also when it raises. A stop file that was already there, older
    than the run's start (left by a run killed before it could remove it), is removed with a line when
    the fit starts instead of stopping this run after its first step; one touched after the start counts."""

    def __init__(self, run_dir: Path, rank: int):
        self.signalled, self.rank, self.previous = False, rank, {}
        self.files = [Path(run_dir) / "STOP"] + ([Path(os.environ["MEGATOK_STOP_FILE"])]
                                                 if os.environ.get("MEGATOK_STOP_FILE") else [])
        self.stale = {f: m for f in self.files if rank == 0 and (m := _mtime(f)) is not None and m < STARTED}

    def on_fit_start(self, trainer):
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        for f, mtime in self.stale.items():
            if _mtime(f) == mtime:  # not touched since the run started
                f.unlink(missing_ok=True)
                print(f"megatok: removed {f}, a stop file older than this run's start (an earlier run's, "
                      f"killed before it removed it); touch it again to stop this run", flush=True)
        self.stale = {}

    def _handle(self, signum, frame):
        self.signalled = True

    def _file(self) -> Path | None:
        return next((f for f in self.files if f.exists()), None)

    @property
    def requested(self) -> bool:
        return self.signalled or (self.rank == 0 and self._file() is not None)

    def reason(self) -> str:
        found = None if self.signalled else self._file()
        return f"stopped by {found}" if found else "stopped by signal"

    def remove_files(self) -> None:
        for f in self.files:
            f.unlink(missing_ok=True)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def stop_requested(self, trainer):
        return self.requested

    def on_fit_end(self, trainer):
        if trainer.stopping:
            trainer.stop_reason = self.reason()
            trainer.logger.log({"step": trainer.step, "split": "event", "event": trainer.stop_reason,
                                "checkpoint": tag_for(trainer.step)})
            if self.rank == 0:
                self.remove_files()  # else the resumed run would stop again at once
        self.restore()

    def on_fit_error(self, trainer, error):
        self.restore()  # Ctrl-C interrupts again


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


class LogMetrics(Callback):
    """A training row every train.log_every steps, and at every checkpoint and evaluation step (so the
    cumulative bytes and FLOPs that a checkpoint saves, and that the head-to-head matches its baseline
    by, are complete) and at a stop; the console follows the rows (MetricsLogger.progress)."""

    def on_step_end(self, trainer):
        if not trainer.log_due:
            return
        trainer.metrics.add("bad_shards", trainer.data.bad_shards)  # this rank's count
        row = trainer.metrics.row(trainer.step, lr=trainer.lr, grad_norm=trainer.engine.grad_norm,
                                  **trainer.data.epochs())  # rank 0's epochs; the checkpoint's: all ranks'
        trainer.logger.log(row)
        trainer.logger.progress(trainer.step, **shown(row))


def shown(row: dict) -> dict[str, float]:
    """A training row's figures on the console: loss, bpb, boundary rate, lr, throughput, MFU (without a
    known peak: TFLOP/s per device) and peak memory, under its row key (which says what was measured)."""
    out = {"loss": row["loss"], "bpb": row["bpb"]}
    if "boundary_rate" in row:
        out["rate"] = row["boundary_rate"]
    out.update({"lr": row["lr"], "bytes/s": row["bytes_per_s"]})
    out.update({"mfu": row["mfu"]} if "mfu" in row else {"tflops/device": row["tflops_per_device"]})
    out.update({k: v for k, v in row.items() if k.endswith("_peak_allocated_gib") or k.endswith("_peak_rss_gib")})
    return out


class Profile(Callback):
    """logging.profile_steps [start, stop]: torch.profiler records optimizer steps start to stop - 1 (the
    CPU, and the GPU where the run is on one); each rank writes its Chrome trace to
    RUN_DIR/profile/steps<start>-<stop>-rank<r>.json when the window closes (or the run ends in it)."""

    def __init__(self, window: list[int], run_dir: Path, rank: int, device: torch.device):
        (self.start, self.stop), self.rank, self.device = window, rank, device
        self.path = Path(run_dir) / "profile" / f"steps{self.start}-{self.stop}-rank{rank}.json"
        self.profiler = None

    def on_step_begin(self, trainer):
        if trainer.step + 1 == self.start:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.start()

    def on_step_end(self, trainer):
        if self.profiler is not None and trainer.step == self.stop - 1:
            self._write(trainer)

    def on_fit_end(self, trainer):
        if self.profiler is not None:
            self._write(trainer)

    def on_fit_error(self, trainer, error):
        if self.profiler is not None:  # no trace: the window did not close
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _write(self, trainer) -> None:
        self.profiler.stop()
        trainer.progress(f"writing the profiler trace {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with trainer.metrics.paused():  # not training time
            self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        if self.rank == 0:
            print(f"megatok: profiler trace of steps {self.start} to {trainer.step}: {self.path} "
                  f"(and one per other rank)", flush=True)
