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
                         "was killed, or writing the step-6 checkpoint takes longer than that (then raise the "
                         "timeout); stopping the job; last good checkpoint: step00000002")
