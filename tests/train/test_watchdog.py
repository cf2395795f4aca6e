"""The watchdog that ends a rank when the training loop stops making progress: its one line names what
the rank was doing, so a checkpoint slower than the timeout reads differently from a lost rank."""

import subprocess
import sys

from tests.conftest import ROOT


def test_the_watchdog_says_what_the_rank_was_doing():
    code = ("import time\n"
            "from megatok.train.dist import Watchdog\n"
            "w = Watchdog(0.5, lambda: 'last good checkpoint: step00000002')\n"
            "w.beat('training step 5')\n"
            "time.sleep(0.3)\n"
            "w.beat('writing the step-6 checkpoint')\n"  # a beat resets the clock and says what comes next
            "time.sleep(10)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "RANK": "3", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 4, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: rank 3: no training progress for ")
    assert line.endswith(" s (train.dist_timeout_s=0.5) while writing the step-6 checkpoint: a rank died, hung or "
                         "was killed, or writing the step-6 checkpoint takes longer than that (then raise "
                         "train.dist_timeout_s); stopping the job; last good checkpoint: step00000002")


def test_a_checkpoint_save_gets_its_own_allowance():
    """train.save_timeout_s: a save may take longer than train.dist_timeout_s, and the line names the key
    that ran out; the next step is held to dist_timeout_s again."""
    code = ("import time\n"
            "from megatok.train.dist import Watchdog\n"
            "w = Watchdog(0.5, lambda: 'last good checkpoint: step00000002')\n"
            "w.beat('writing the step-6 checkpoint', (3.0, 'train.save_timeout_s'))\n"
            "time.sleep(1.5)\n"  # three times dist_timeout_s: still within the save's allowance
            "print('survived the save', flush=True)\n"
            "w.beat('writing the step-7 checkpoint', (1.0, 'train.save_timeout_s'))\n"
            "time.sleep(10)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "RANK": "0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 4, r.stderr
    assert r.stdout == "survived the save\n"
    (line,) = r.stderr.splitlines()
    assert "(train.save_timeout_s=1) while writing the step-7 checkpoint: " in line, line
    assert "(then raise train.save_timeout_s); stopping the job; last good checkpoint: step00000002" in line

    code = ("import time\n"
            "from megatok.train.dist import Watchdog\n"
            "w = Watchdog(0.5, lambda: 'x')\n"
            "w.beat('writing the step-6 checkpoint', (30.0, 'train.save_timeout_s'))\n"
            "w.beat('training step 7')\n"  # back to the default limit
            "time.sleep(10)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "RANK": "0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 4 and "(train.dist_timeout_s=0.5) while training step 7" in r.stderr, r.stderr


def test_the_process_group_timeout_is_the_longer_allowance():
    """(That dist.init gets it, so a rank waits out another's slow save, is shown by
    test_reliability.py::test_a_checkpoint_slower_than_the_timeout_is_waited_for_with_save_timeout_s.)"""
    from megatok.config import TrainConfig

    assert TrainConfig().collective_timeout_s == 600
    assert TrainConfig(dist_timeout_s=900, save_timeout_s=3600).collective_timeout_s == 3600
    assert TrainConfig(dist_timeout_s=900, save_timeout_s=60).collective_timeout_s == 900
