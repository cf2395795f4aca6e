"""Python processes without an interpreter's start-up each: ``python -u SCRIPT ARGS`` and
``python -m MODULE ARGS`` forked from a server that has imported torch, DeepSpeed and megatok once.

A process of the trainer spends about 5 s of CPU importing torch, DeepSpeed and the trainer (and, on its
first backward, torch._dynamo and the inductor modules DeepSpeed's ZeRO reduction pulls in): most of a
test's few-step run. Here a server (multiprocessing's forkserver) imports all of it once per test worker
(tests/_preload.py), and each process is a fork of it that then runs the script or module as the
interpreter would: its own session, working directory, environment, stdout and stderr (files, at the
file-descriptor level), ``__main__``, exit status and exit handlers. The trainer and the DeepSpeed engine
are the real ones. What a fork cannot reproduce is what torch reads from the environment when it is
imported: a test that sets such variables (TORCH_LOGS, TORCHINDUCTOR_CACHE_DIR, ...) starts a fresh
interpreter (tests.conftest.pretrain does when given ``env``). MEGATOK_TEST_FRESH=1 makes every test
start fresh interpreters. :class:`Ranks` starts a test's processes either way (one, or the ranks of a job
with the variables a launcher sets) and :func:`run` is ``subprocess.run`` over it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_context = None


def enabled() -> bool:
    return not os.environ.get("MEGATOK_TEST_FRESH")


def context():
    """The forkserver context; its server imports tests/_preload.py when the first process starts."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["tests._preload"])
    return _context


class Forked:
    """``python -u *argv`` (argv: a script and its arguments, or "-m", a module and its arguments) as a fork
    of the server, its output in the files ``stdout`` and ``stderr``; with what the tests use of a Popen:
    pid (the leader of its own session, so os.killpg ends it and its children), poll(), wait(), returncode."""

    def __init__(self, argv: list[str], env: dict, stdout: str, stderr: str, cwd: str):
        self.process = context().Process(target=_run, args=(list(argv), dict(env), stdout, stderr, str(cwd)),
                                         name=Path(argv[1] if argv[0] == "-m" else argv[0]).name)
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        return self.process.exitcode


class Ranks:
    """``nproc`` ranks of ``python -u script args`` with the variables a launcher sets (one rank: a plain
    process, none set), forked from tests/preloaded.py's server (``forked``) or fresh interpreters, each in
    its own session; with what a test uses of a Popen: poll(), returncode, wait(), communicate(), kill().
    Outputs are rank 0's then rank 1's ..."""

    def __init__(self, script: str, args: list[str], nproc: int, env: dict, forked: bool, cwd=ROOT):
        from megatok.train.dist import free_port

        port, self.procs, self.files = str(free_port()), [], []
        self.tmp = tempfile.TemporaryDirectory()
        self.args = [sys.executable, script, *args]
        for rank in range(nproc):
            out, err = Path(self.tmp.name) / f"{rank}.out", Path(self.tmp.name) / f"{rank}.err"
            self.files.append((out, err))
            rank_env = env if nproc == 1 else {
                **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            if forked:
                self.procs.append(Forked([script, *args], rank_env, str(out), str(err), cwd))
            else:
                with out.open("w") as o, err.open("w") as e:
                    self.procs.append(subprocess.Popen([sys.executable, "-u", script, *args], stdout=o, stderr=e,
                                                       env=rank_env, cwd=cwd, start_new_session=True))

    def poll(self):
        codes = [p.poll() for p in self.procs]
        return None if None in codes else next((c for c in codes if c != 0), 0)

    @property
    def returncode(self):
        return self.poll()

    def kill(self) -> None:
        """SIGKILL to every live rank's session, and wait for them."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def wait(self, timeout: float, grace: float = 15):
        """Until every rank has ended; when one fails the others are killed after ``grace`` s (as a
        launcher does). Past ``timeout`` s all are killed and subprocess.TimeoutExpired is raised."""
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in self.procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                self.kill()
                if now > deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout, *self.output())
            time.sleep(0.05)
        return self.returncode

    def output(self) -> tuple[str, str]:
        """(stdout, stderr): each the ranks' in rank order."""
        return tuple("".join(pair[i].read_text() if pair[i].exists() else "" for pair in self.files)
                     for i in range(2))

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """As a Popen's with stderr=STDOUT: (the ranks' stdout then their stderr, None), once they end."""
        self.wait(timeout if timeout is not None else 10**9)
        out, err = self.output()
        return out + err, None

    def close(self) -> None:
        self.kill()
        self.tmp.cleanup()


def run(argv: list[str], *, env: dict, cwd, timeout: float, forked: bool = True) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, *argv], capture_output=True, text=True, ...)`` gives, forked (or a fresh
    interpreter); a timeout kills the process's session and raises subprocess.TimeoutExpired."""
    job = Ranks(argv[0], argv[1:], 1, env, forked, cwd)
    try:
        job.wait(timeout)
        return subprocess.CompletedProcess(job.args, job.returncode, *job.output())
    finally:
        job.close()


def _run(argv: list[str], env: dict, stdout: str, stderr: str, cwd: str) -> None:
    """In the child: become ``python -u *argv`` in ``cwd`` with ``env``, writing to the files ``stdout`` and
    ``stderr``, and leave as the interpreter would."""
    import atexit
    import io
    import runpy
    import threading
    import traceback

    os.setsid()
    # A fresh interpreter's multiprocessing: the platform's start method (a forkserver child inherits
    # forkserver: DataLoader workers would start from a new server and outlive a killed rank).
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.current_process().name = "MainProcess"
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in argv[0]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, status 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as the interpreter's exit does: non-daemon threads, then the exit handlers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if not stream.closed:  # a command may close its own stdout
            stream.flush()
    os._exit(code)
