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
start fresh interpreters.
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


def run(argv: list[str], *, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, *argv], capture_output=True, text=True, ...)`` gives, forked; a
    timeout kills the process's session and raises subprocess.TimeoutExpired."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        p = Forked(argv, env, str(out), str(err), cwd)
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            p.wait(0.05)
        text = [f.read_text() if f.exists() else "" for f in (out, err)]  # none: it failed before opening them
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, *text)
        return subprocess.CompletedProcess([sys.executable, *argv], p.returncode, *text)


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
