"""Where the studies train: launch/pretrain.py of the checkout this package is in, as users start it, each run
in a process group of its own that a budget, an interrupt or an error stops at a checkpoint; and whether a
run has finished."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
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


def log(msg: str) -> None:
    print(f"replicate: {msg}", flush=True)


class BudgetSpent(Exception):
    """--budget-s ran out (a run stopped at its checkpoint, or too little left to start one)."""


class StudyStopped(BaseException):
    """SIGTERM or SIGHUP reached the study (a scheduler's limit, a closed terminal), or its run stopped before
    its end: the running run is stopped at a checkpoint first. A BaseException, as KeyboardInterrupt: no
    ``except Exception`` on the way swallows it."""


@contextlib.contextmanager
def stop_signals():
    """SIGTERM and SIGHUP raise StudyStopped once (a second while the study winds down is ignored), except
    where they were ignored (nohup); the handlers before are restored after."""
    stopping = []

    def stopped(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise StudyStopped(f"stopped by {signal.Signals(signum).name}")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, stopped)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


class Budget:
    """The study's wall-clock budget (None: none). No run starts, and no finished run is evaluated, in its
    last ``RESERVE_S`` seconds (start-up, a first step and the evaluation); a run still training ``GRACE_S``
    before its end is asked to stop (:func:`stop_run`), so that it has ended, checkpoint written, by then."""
    RESERVE_S, GRACE_S = 90.0, 60.0

    def __init__(self, seconds: float | None):
        self.seconds, self.end = seconds, None if seconds is None else time.monotonic() + seconds

    def until_stop(self) -> float | None:
        """Seconds until a running run must be asked to stop (None: never)."""
        return None if self.end is None else max(0.0, self.end - self.GRACE_S - time.monotonic())

    def check(self, what: str) -> None:
        left = None if self.end is None else self.end - time.monotonic()
        if left is not None and left < self.RESERVE_S:
            raise BudgetSpent(f"--budget-s {self.seconds:g}: {max(0.0, left):.0f} s left, {what}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_run(proc: subprocess.Popen, run_dir: str, grace: float) -> None:
    """Ask a run started in its own process group to stop and wait for every process of the group: RUN_DIR/STOP
    (the trainer's stop file: every rank stops at the same step with a checkpoint, under any launcher), up to
    ``grace`` seconds; then SIGTERM to the group, 10 s; then SIGKILL. A second interrupt while waiting kills
    the group at once. The stop file does not outlive the group."""
    try:
        end = time.monotonic() + grace
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "STOP").touch()
        for sig, until in ((None, end), (signal.SIGTERM, time.monotonic() + grace + 10)):
            if sig is not None and _group_alive(proc.pid):
                os.killpg(proc.pid, sig)
            while (proc.poll() is None or _group_alive(proc.pid)) and time.monotonic() < until:
                time.sleep(0.2)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        (Path(run_dir) / "STOP").unlink(missing_ok=True)


def _end_group(pgid: int) -> None:
    """What is left of a run's group after its leader exited (orphaned ranks or workers): SIGTERM, 10 s, SIGKILL."""
    if not _group_alive(pgid):
        return
    os.killpg(pgid, signal.SIGTERM)
    end = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def train(run: dict, nproc: int, budget: Budget = Budget(None)) -> None:
    """Train ``run`` to its end in a process group of its own; on the budget's end, an interrupt or an error
    here, the run is stopped at a checkpoint (stop_run) before this returns or raises."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))}
    cmd = local_command(run, nproc)
    budget.check(f"{run['name']} not started")
    log(f"{run['name']}: {shlex.join(cmd)}")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # a Ctrl-C reaches the study, which stops it
    try:
        rc = proc.wait(timeout=budget.until_stop())
    except BaseException as e:  # the budget, Ctrl-C, SIGTERM to the study: the run goes first, at a checkpoint
        try:
            if isinstance(e, subprocess.TimeoutExpired):
                log(f"{run['name']}: --budget-s {budget.seconds:g} nearly spent: stopping it at a checkpoint")
        finally:
            stop_run(proc, run["run_dir"], Budget.GRACE_S - 10)  # its SIGTERM phase takes 10 s more at most
        if isinstance(e, subprocess.TimeoutExpired):
            raise BudgetSpent(f"--budget-s {budget.seconds:g} spent while {run['name']} trained (stopped at a "
                              f"checkpoint)") from None
        raise
    _end_group(proc.pid)
    if rc:
        raise RuntimeError(f"{run['name']} failed with exit code {rc}; rerun the same command to resume it")
    if not finished(run):  # its stop file, or a signal sent to it: a checkpoint, not the run's end
        raise StudyStopped(f"{run['name']} stopped before its last step (a stop file or a signal); rerun to resume it")
