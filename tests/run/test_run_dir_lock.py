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


def test_a_rank_that_does_not_see_rank_0s_lock_file_ends_the_start(tmp_path, processes):
    """A run directory that is not one directory shared by every node: another rank does not find the lock
    file rank 0 wrote (or finds another run's), and says so in one line."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()  # b: the same path on another node, not shared
    processes.append(zero := holder(tmp_path / "a", "rank0"))
    for where, token in ((tmp_path / "b", zero.token), (tmp_path / "a", "another run's")):
        with pytest.raises(RunDirInUse) as e:
            RunLock(where).join(token, timeout_s=0.5)
        assert not e.value.waitable and "\n" not in str(e.value)
        assert str(e.value).startswith(f"{where / 'lock'}: rank 0's lock file is not there as rank 0 wrote it, seen "
                                       f"from host {socket.gethostname()} (")
        assert str(e.value).endswith("train.run_dir must be one directory shared by every node")
    RunLock(tmp_path / "a").join(zero.token)  # the same directory: joined


def test_on_another_host_a_lock_that_does_not_exclude_it_is_an_error_unless_allowed(tmp_path, processes, monkeypatch,
                                                                                   capsys):
    """A rank on another host than rank 0's tries rank 0's lock: refused where the filesystem's locks are shared
    (here: one kernel); granted where they are local to each node (simulated), which ends the start with one
    line, or warns with MEGATOK_ALLOW_NODE_LOCAL_LOCKS=1."""
    processes.append(zero := holder(tmp_path, "rank0"))
    host = socket.gethostname()
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    RunLock(tmp_path).join(zero.token)  # rank 0's lock excludes this host: nothing said
    assert capsys.readouterr().out == ""
    real = run_lock._flock
    monkeypatch.setattr(run_lock, "_flock", lambda fd, how, path: path.name == "lock" or real(fd, how, path))
    with pytest.raises(RunDirInUse) as e:
        RunLock(tmp_path).join(zero.token)
    assert not e.value.waitable and "\n" not in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'lock'}: rank 0 (host {host}) holds this lock, and host node-b could "
                                   f"take it too: the filesystem's locks are local to each node")
    assert str(e.value).endswith("set MEGATOK_ALLOW_NODE_LOCAL_LOCKS=1 to run anyway")
    monkeypatch.setenv("MEGATOK_ALLOW_NODE_LOCAL_LOCKS", "1")
    RunLock(tmp_path).join(zero.token)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("megatok: warning: ") and line.endswith("(MEGATOK_ALLOW_NODE_LOCAL_LOCKS=1: running anyway)")


UNSHARED = """
import os, sys, types, torch, torch.distributed as dist
from megatok.run.lock import RunLock
from megatok.train.checkpointer import Checkpointer
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
RunLock.join.__defaults__ = (1.0,)  # look for rank 0's lock file for 1 s (30 s in a run)
train = types.SimpleNamespace(run_dir=os.path.join(os.environ["RUNS"], "a" if rank == 0 else "b"), save_every=10,
                              keep_checkpoints=3, keep_every=None, save_timeout_s=None)
try:
    Checkpointer(train, rank).take_lock()
    result = "held"
except Exception as e:
    result = f"{type(e).__name__}: {e}"
torch.save(result, out)
os._exit(0)
"""


def test_a_run_directory_one_rank_does_not_share_ends_the_start_on_every_rank(tmp_path, monkeypatch):
    from tests.conftest import two_gloo_ranks

    (tmp_path / "b").mkdir()
    monkeypatch.setenv("RUNS", str(tmp_path))
    zero, one = two_gloo_ranks(tmp_path, UNSHARED)
    assert zero == one and zero.startswith(f"RunDirInUse: {tmp_path / 'b' / 'lock'}: rank 0's lock file is not "
                                           f"there as rank 0 wrote it"), zero
