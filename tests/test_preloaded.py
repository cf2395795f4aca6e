"""The suite's forked processes (tests/preloaded.py) behave as a fresh ``python -u SCRIPT`` would: their
own working directory, environment, stdout and stderr, exit status, exit handlers, multiprocessing start
method and session."""

import os
import subprocess
import sys

import pytest

from tests import preloaded

SCRIPT = """
import atexit, multiprocessing, os, sys
atexit.register(lambda: print("exit handler ran"))
print(os.getcwd(), os.environ.get("PROBE"), multiprocessing.get_start_method(), multiprocessing.current_process().name,
      os.getpgid(0) == os.getpid(), sys.argv[1:])
os.write(2, b"to fd 2\\n")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("fresh", [False, True])
def test_a_forked_process_is_what_a_fresh_interpreter_gives(tmp_path, fresh):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PROBE": "seen"}
    if fresh:
        r = subprocess.run([sys.executable, "-u", str(script), "3"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, start_new_session=True)
    else:
        r = preloaded.run([str(script), "3"], env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout.splitlines() == [f"{tmp_path} seen fork MainProcess True ['3']", "exit handler ran"]
    assert r.stderr == "to fd 2\n"


def test_a_module_runs_as_main_and_a_traceback_is_status_1(tmp_path):
    (tmp_path / "x.json").write_text('{"b": 1, "a": 2}')
    r = preloaded.run(["-m", "json.tool", "--sort-keys", "--compact", "x.json"], env=dict(os.environ), cwd=tmp_path,
                      timeout=60)
    assert r.returncode == 0 and r.stdout == '{"a":2,"b":1}\n', r.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('boom')\n")
    r = preloaded.run([str(bad)], env=dict(os.environ), cwd=tmp_path, timeout=60)
    assert r.returncode == 1 and r.stderr.rstrip().endswith("ValueError: boom")


def test_a_process_past_its_timeout_is_killed(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        preloaded.run([str(slow)], env=dict(os.environ), cwd=tmp_path, timeout=3)
    assert e.value.output == "started\n"
