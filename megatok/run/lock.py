"""One writer per run directory: the lock a training run holds on RUN_DIR for as long as it runs.

Two files, each locked with flock(2), which the kernel (on a shared filesystem, its lock manager: NFS,
Lustre mounted with ``-o flock``, GPFS, ...) releases when the holding process ends, however it ends:

- ``RUN_DIR/lock``: held exclusively by the run's rank 0, and naming it (host, pid, Slurm job id, since
  when, a token of the run). A second run fails at once, naming that holder, or waits for it.
- ``RUN_DIR/lock.ranks``: held shared by every rank of the run. A new holder of ``lock`` also needs it
  exclusively for a moment: the ranks of a run whose rank 0 has ended (one on a lost node, still in a
  collective until its timeout) keep a new run from starting, so two runs never write at once.

A lock whose file still names a holder but is free was left by a run that ended without releasing it
(killed, failed, its node lost): the next run takes it over and says whose it was. Before each checkpoint
the holder checks that the file still names its run (``verify``): a run whose lock was taken from it
(its filesystem's lock manager expired it; the file removed by hand) stops instead of publishing.

    lock = RunLock(run_dir)
    previous = lock.acquire(wait_s=0)   # rank 0: RunDirInUse naming the holder, or the dead holder taken over
    lock.join(token)                    # every other rank, once rank 0 holds it
    lock.verify()                       # rank 0, before publishing a checkpoint
    lock.release()                      # a run that ended cleanly: the files no longer name it
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

LOCK, RANKS = "lock", "lock.ranks"


class RunDirInUse(RuntimeError):
    """Another run holds the run directory (its message names the holder; ``waitable``: a later start may
    get it), or took it over from this one."""

    def __init__(self, message: str, waitable: bool = True):
        super().__init__(message)
        self.waitable = waitable


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    job: str | None  # Slurm's job id, where there is one
    since: str
    token: str

    @classmethod
    def me(cls, token: str) -> Holder:
        job = os.environ.get("SLURM_JOB_ID")
        if job and os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
            job += f" (requeued {os.environ['SLURM_RESTART_COUNT']} time(s))"
        return cls(socket.gethostname(), os.getpid(), job, time.strftime("%Y-%m-%d %H:%M:%S"), token)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None

    def __str__(self) -> str:
        job = f", Slurm job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}, since {self.since}"


_held: dict[Path, RunLock] = {}  # what this process holds, by run directory


def _close_in_child() -> None:
    """A forked child (a data loader's worker) does not keep its parent's locks: they end with the parent."""
    for lock in _held.values():
        for fd in (lock.fd, lock.ranks_fd):
            if fd is not None:
                os.close(fd)
        lock.fd = lock.ranks_fd = None
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _flock(fd: int, how: int, path: Path) -> bool:
    """flock(2) without blocking: whether it was granted; an error on a filesystem without locks."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise RunDirInUse(f"{path}: the filesystem does not lock files ({e.strerror}); a run directory on it "
                              f"cannot be kept to one writer (for Lustre, mount with -o flock)", waitable=False) from None
        raise


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class RunLock:
    """The lock of one run directory, as this process holds it (see the module's docstring)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path, self.ranks_path = self.run_dir / LOCK, self.run_dir / RANKS
        self.fd: int | None = None
        self.ranks_fd: int | None = None
        self.token: str | None = None

    def holder(self) -> Holder | None:
        """Who the lock file names (None: nobody, or no file)."""
        try:
            return Holder.parse(self.path.read_text())
        except FileNotFoundError:
            return None

    def acquire(self, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None,
                poll_s: float = 0.5) -> Holder | None:
        """Take the lock for a run whose rank 0 this process is, waiting up to ``wait_s`` seconds for
        another run to end (``on_wait(why)`` once, if it does wait). Returns the holder a lock was taken
        over from (it ended without releasing it), else None; RunDirInUse, naming the holder, when the
        wait is over (at once for ``wait_s`` 0). A lock this process holds already is kept."""
        key = self.run_dir.resolve()
        if key in _held:  # an earlier Trainer of this process, which failed and kept it
            held = _held[key]
            self.fd, self.ranks_fd, self.token = held.fd, held.ranks_fd, held.token
            _held[key] = self
            return None
        deadline, told = time.monotonic() + wait_s, False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        ranks_fd = os.open(self.ranks_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                why = self._try(fd, ranks_fd)
                if why is None:
                    break
                if time.monotonic() >= deadline:
                    raise RunDirInUse(why)
                if not told and on_wait is not None:
                    on_wait(why)
                    told = True
                time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        except BaseException:
            os.close(fd)
            os.close(ranks_fd)
            raise
        previous = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        self.fd, self.ranks_fd, self.token = fd, ranks_fd, secrets.token_hex(8)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(Holder.me(self.token))).encode(), 0)
        os.fsync(fd)
        _held[key] = self
        return previous

    def _try(self, fd: int, ranks_fd: int) -> str | None:
        """One attempt: None when both locks are taken (``lock.ranks`` shared by then), else why not."""
        if not _flock(fd, fcntl.LOCK_EX, self.path):
            holder = self.holder()
            return (f"{self.run_dir} is in use by another run: "
                    f"{holder or 'a process that is starting (it has not written its name yet)'}")
        if not _same_file(fd, self.path):  # removed (and made anew) by hand meanwhile
            fcntl.flock(fd, fcntl.LOCK_UN)
            return f"{self.path} was replaced while this run took it"
        if not _flock(ranks_fd, fcntl.LOCK_EX, self.ranks_path):
            fcntl.flock(fd, fcntl.LOCK_UN)
            holder = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
            return (f"{self.run_dir} is still written by ranks of the run that held it "
                    f"({holder or 'unknown'}): its rank 0 has ended, others still run (a rank cut off from "
                    f"the others ends within its train.dist_timeout_s)")
        fcntl.flock(ranks_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # no other run can come between: ``lock`` is ours
        return None

    def join(self, token: str, timeout_s: float = 30.0) -> None:
        """Every rank but 0, once rank 0 holds the lock with ``token``: a shared lock on ``lock.ranks``
        for as long as this process runs, so a later run waits for it too. First (:meth:`check_shared`):
        that this rank sees rank 0's lock file, and that on another host rank 0's lock excludes it too."""
        self.check_shared(token, timeout_s)
        self.token = token
        self.ranks_fd = os.open(self.ranks_path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        while not _flock(self.ranks_fd, fcntl.LOCK_SH, self.ranks_path):  # a new run's rank 0 looking: it fails
            if time.monotonic() > deadline:
                raise RunDirInUse(f"{self.ranks_path}: another run holds it exclusively")
            time.sleep(0.2)
        _held[self.run_dir.resolve()] = self

    def check_shared(self, token: str, timeout_s: float = 30.0) -> None:
        """RunDirInUse (not waitable) when this rank does not see the lock file rank 0 wrote with ``token``
        within ``timeout_s`` (the run directory is not one directory shared by every node), or when, on another
        host than rank 0's, it can take that lock itself: the filesystem's locks are local to each node (NFS
        mounted with local_lock, Lustre with localflock, ...), so nothing keeps a second run out. That one is a
        warning instead with MEGATOK_ALLOW_NODE_LOCAL_LOCKS=1."""
        deadline, holder = time.monotonic() + timeout_s, None
        while (holder := self.holder()) is None or holder.token != token:  # (a shared filesystem may lag)
            if time.monotonic() > deadline:
                raise RunDirInUse(f"{self.path}: rank 0's lock file is not there as rank 0 wrote it, seen from host "
                                  f"{socket.gethostname()} ({'no such file' if holder is None else holder}): "
                                  f"train.run_dir must be one directory shared by every node", waitable=False)
            time.sleep(0.2)
        if holder.host == socket.gethostname():
            return  # one kernel: its locks exclude
        fd = os.open(self.path, os.O_RDWR)
        try:
            local = _flock(fd, fcntl.LOCK_EX, self.path)  # granted only where rank 0's lock is not seen
        finally:
            os.close(fd)  # (and with it the lock, if it was granted)
        if not local:
            return
        why = (f"{self.path}: rank 0 (host {holder.host}) holds this lock, and host {socket.gethostname()} could "
               f"take it too: the filesystem's locks are local to each node (NFS local_lock, Lustre localflock, "
               f"BeeGFS without global locks), so a second run on this directory would not be kept out")
        if os.environ.get("MEGATOK_ALLOW_NODE_LOCAL_LOCKS") != "1":
            raise RunDirInUse(f"{why}; mount it with shared locks, or set MEGATOK_ALLOW_NODE_LOCAL_LOCKS=1 to run "
                              f"anyway", waitable=False)
        print(f"megatok: warning: {why} (MEGATOK_ALLOW_NODE_LOCAL_LOCKS=1: running anyway)", flush=True)

    def verify(self) -> None:
        """Rank 0, before publishing a checkpoint: the lock file is still this run's."""
        holder = self.holder()
        if holder is None or holder.token != self.token or self.fd is None or not _same_file(self.fd, self.path):
            raise RunDirInUse(f"{self.run_dir} was taken over by another run ({holder or 'its lock file removed'}) "
                              f"while this run held it: this run stops without writing more", waitable=False)

    def release(self) -> None:
        """The run ended cleanly: the lock file names nobody (rank 0) and the locks are released."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
        for fd in (self.ranks_fd, self.fd):
            if fd is not None:
                os.close(fd)  # the lock goes with the last descriptor
        self.fd = self.ranks_fd = None
        _held.pop(self.run_dir.resolve(), None)
