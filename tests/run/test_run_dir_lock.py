"""One writer per run directory (megatok.run.lock): a second run fails at once naming the holder, or waits
for it; a lock left by a holder that died is taken over, never while any rank of its run still runs; a run
whose lock was taken from it stops before publishing. Holders are real processes on this machine; the
trainer's use of the lock runs launch/pretrain.py. (Across the nodes of a cluster: tests/cluster.)"""

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatok.run import lock as run_lock
from megatok.run.lock import RunDirInUse, RunLock
from tests.conftest import ROOT, TINY, pretrain

# A process that takes the lock as a run's rank 0 ("rank0") or joins a run's token as another rank
# ("rank1 TOKEN"), optionally forks a child that outlives it by 10 s ("fork"), says so, and waits to be killed;
# "release SECONDS" holds it that long, then releases it cleanly and exits.
HOLDER = """
import os, sys, time
from megatok.run.lock import RunLock
lock = RunLock(sys.argv[1])
role = sys.argv[2]
if role == "rank1":
    lock.join(sys.argv[3])
else:
    lock.acquire()
if "fork" in sys.argv and os.fork() == 0:
    time.sleep(10)
    os._exit(0)
print("held", lock.token, flush=True)
if role == "release":
    time.sleep(float(sys.argv[3]))
    lock.release()
    sys.exit(0)
time.sleep(120)
"""


def holder(run, *argv, env=None):
    """A holding process (HOLDER) once it holds; its token in ``.token``."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), *argv], stdout=subprocess.PIPE, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    line = p.stdout.readline().split()
    assert line[:1] == ["held"], line
    p.token = line[1]
    return p


@pytest.fixture
def processes():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def kill(p):
    p.kill()
    p.wait()


def test_a_second_run_fails_at_once_naming_the_holder(tmp_path, processes):
    first = holder(tmp_path, "rank0", env={"SLURM_JOB_ID": "4242"})
    processes.append(first)
    t = time.monotonic()
    with pytest.raises(RunDirInUse) as e:
        RunLock(tmp_path).acquire()
    assert time.monotonic() - t < 1
    assert str(e.value).startswith(f"{tmp_path} is in use by another run: host {socket.gethostname()}, "
                                   f"pid {first.pid}, Slurm job 4242, since ")
    assert e.value.waitable
    held = json.loads((tmp_path / "lock").read_text())  # the refused start changed nothing
    assert (held["pid"], held["token"]) == (first.pid, first.token)


def test_a_second_run_that_asks_to_waits_for_the_holder_to_end(tmp_path, processes):
    processes.append(holder(tmp_path, "release", "1.5"))
    told = []
    t = time.monotonic()
    lock = RunLock(tmp_path)
    assert lock.acquire(wait_s=30, on_wait=told.append, poll_s=0.1) is None  # released cleanly: nothing left
    assert 1 < time.monotonic() - t < 10
    assert len(told) == 1 and "is in use by another run" in told[0]
    assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / "lock").read_text() == ""  # a clean end names nobody


def test_a_lock_left_by_a_killed_holder_is_taken_over_saying_whose_it_was(tmp_path, processes):
    first = holder(tmp_path, "rank0", env={"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "1"})
    processes.append(first)
    kill(first)  # as on a lost node: no chance to release
    lock = RunLock(tmp_path)
    previous = lock.acquire()
    try:
        assert (previous.pid, previous.job, previous.token) == (first.pid, "17 (requeued 1 time(s))", first.token)
        assert json.loads((tmp_path / "lock").read_text())["token"] == lock.token != first.token
    finally:
        lock.release()


def test_ranks_of_a_run_whose_rank_0_died_keep_a_new_run_out_until_they_end(tmp_path, processes):
    """Never two writers: rank 0 of the old run is gone, but another of its ranks (on a node cut off from
    the others, until its timeout) could still write into the run directory."""
    rank0 = holder(tmp_path, "rank0")
    rank1 = holder(tmp_path, "rank1", rank0.token)
    processes += [rank0, rank1]
    kill(rank0)
    with pytest.raises(RunDirInUse, match=f"is still written by ranks of the run that held it .*pid {rank0.pid}, "):
        RunLock(tmp_path).acquire()
    kill(rank1)
    lock = RunLock(tmp_path)
    assert lock.acquire().pid == rank0.pid
    lock.release()


def test_a_forked_child_of_the_holder_does_not_keep_its_lock(tmp_path, processes):
    """A data loader's worker is forked from rank 0: when rank 0 dies, its lock goes, whatever the worker does."""
    first = holder(tmp_path, "rank0", "fork")
    processes.append(first)
    (child,) = map(int, open(f"/proc/{first.pid}/task/{first.pid}/children").read().split())
    kill(first)
    lock = RunLock(tmp_path)
    assert lock.acquire(wait_s=5, poll_s=0.05).pid == first.pid  # the child closes its copies just after the fork
    assert os.kill(child, 0) is None  # and sleeps on
    lock.release()


def test_a_run_whose_lock_was_taken_over_finds_out_before_it_writes(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        lock.verify()
        held = json.loads((tmp_path / "lock").read_text())
        (tmp_path / "lock").write_text(json.dumps({**held, "pid": 1, "token": "another run"}))
        with pytest.raises(RunDirInUse, match="was taken over by another run .*pid 1, .*stops without writing more") as e:
            lock.verify()
        assert not e.value.waitable
        (tmp_path / "lock").unlink()  # removed by hand
        with pytest.raises(RunDirInUse, match="its lock file removed"):
            lock.verify()
    finally:
        lock.release()


def test_this_process_keeps_a_lock_it_holds(tmp_path):
    """A Trainer whose fit failed keeps the lock (its other ranks may still write); another Trainer of the same
    process on the same directory goes on with it."""
    first = RunLock(tmp_path)
    first.acquire()
    second = RunLock(tmp_path / ".")
    assert second.acquire() is None and second.token == first.token
    second.release()
    third = RunLock(tmp_path)
    assert third.acquire() is None and third.token != first.token  # released: a new hold
    third.release()


def test_a_filesystem_without_locks_is_one_line(tmp_path, monkeypatch):
    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(RunDirInUse, match="the filesystem does not lock files .*mount with -o flock") as e:
        RunLock(tmp_path).acquire()
    assert not e.value.waitable and not run_lock._held


def args(shards, run, *extra):
    return ["--config", "configs/tiny.json", "--set", *TINY, f"data.shards={shards}", f"train.run_dir={run}",
            "train.micro_batch_size=2", "train.global_batch_size=2", "data.num_workers=1", *extra]


def test_a_second_launch_on_a_live_run_directory_fails_at_once_or_waits(shards, tmp_path, monkeypatch):
    """launch/pretrain.py while another run holds train.run_dir (here this process): exit 5 and one line
    naming the holder, nothing written; --wait-for-lock waits for it to end, then trains; a run that ends
    cleanly leaves the lock naming nobody."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    other = RunLock(run)
    other.acquire()
    t = time.monotonic()
    r = pretrain(args(shards, run, "train.max_steps=1"), check=False)
    assert r.returncode == 5, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith(
        f"error: train.run_dir: {run} is in use by another run: host {socket.gethostname()}, pid {os.getpid()}, "
        f"Slurm job 31337, since ")
    assert r.stderr.splitlines()[-1].endswith(
        f"; wait for it to end, or stop it (touch {run / 'STOP'}), or start with --wait-for-lock SECONDS")
    assert time.monotonic() - t < 60 and "Traceback" not in r.stderr
    assert sorted(p.name for p in run.iterdir()) == ["lock", "lock.ranks"]  # no config.json, no checkpoint

    threading.Timer(3.0, other.release).start()
    r = pretrain(args(shards, run, "train.max_steps=1", "--wait-for-lock", "120"))
    assert f"megatok: {run} is in use by another run: host " in r.stdout and "waiting up to 120 s" in r.stdout
    assert (run / "checkpoints" / "step00000001").is_dir()
    assert (run / "lock").read_text() == ""
