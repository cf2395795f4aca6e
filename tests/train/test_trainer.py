"""Trainer(cfg).fit() called in-process, as the trainer's module docstring presents it (launch/pretrain.py
ends its process after any error; a caller in the same process lives on)."""

import pytest

from tests.conftest import TINY, python

pytestmark = pytest.mark.dist

SCRIPT = """
import multiprocessing, signal, sys, threading, time
from megatok.config import load_config
from megatok.train.callbacks import Callback
from megatok.train.trainer import Trainer

cfg = load_config("configs/tiny.json", sys.argv[2:])
# a fresh interpreter's handlers (a test worker's processes may inherit SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Boom(Callback):
    def on_step_end(self, trainer):
        if trainer.step == 1:
            raise ValueError("boom in a user callback")


def teardown_state(trainer):
    return {"watchdogs": [t.name for t in threading.enumerate() if t.name == "megatok-watchdog"],
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "children": multiprocessing.active_children(), "metrics_closed": trainer.logger.file.closed}


import megatok.train.trainer as trainer_module
real_logger = trainer_module.MetricsLogger
def no_logger(*args, **kwargs):
    raise OSError("metrics file not writable")
trainer_module.MetricsLogger = no_logger
try:
    Trainer(cfg, resume="none")
except OSError as e:
    print("start failed:", e, "children:", multiprocessing.active_children(), flush=True)
trainer_module.MetricsLogger = real_logger

trainer = Trainer(cfg, resume="none", callbacks=[Boom()])
print("built, handlers untouched:", signal.getsignal(signal.SIGINT) is signal.default_int_handler
      and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
try:
    trainer.fit()
except ValueError as e:
    print("raised:", e, flush=True)
print("after the error:", teardown_state(trainer), flush=True)
try:  # Ctrl-C interrupts again
    signal.raise_signal(signal.SIGINT)
    time.sleep(1)
except KeyboardInterrupt:
    print("interrupted", flush=True)
time.sleep(float(sys.argv[1]))  # past train.dist_timeout_s: a watchdog left running would end the process
print("survived", flush=True)
trainer = Trainer(cfg, resume="auto")  # the same process trains on
row = trainer.fit()
print("trained to step", row["step"], flush=True)
print("after the fit:", teardown_state(trainer), flush=True)
"""


def test_a_fit_that_raises_in_process_leaves_no_watchdog_and_restores_the_signal_handlers(shards, tmp_path):
    """A user callback raises at step 1: the error reaches the caller, and by then the watchdog thread has
    ended (it would os._exit(4) train.dist_timeout_s later), SIGINT/SIGTERM have their handlers back
    (Ctrl-C interrupts), the data worker has ended and metrics.jsonl is closed. The process then trains
    another Trainer to the end. Before that: a Trainer whose start fails after its data stream opened
    leaves no reader worker, and a Trainer built but not yet fitted leaves the signal handlers alone."""
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    timeout = 4
    r = python(script, timeout + 3, *TINY, f"data.shards={shards}", f"train.run_dir={tmp_path / 'run'}",
               "train.max_steps=3", "train.micro_batch_size=2", "train.global_batch_size=2",
               f"train.dist_timeout_s={timeout}", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    clean = "{'watchdogs': [], 'sigint': True, 'sigterm': True, 'children': [], 'metrics_closed': True}"
    lines = [ln for ln in r.stdout.splitlines() if not ln.startswith("megatok:")]
    assert lines == ["start failed: metrics file not writable children: []", "built, handlers untouched: True",
                     "raised: boom in a user callback", f"after the error: {clean}", "interrupted", "survived",
                     "trained to step 3", f"after the fit: {clean}"], r.stdout + r.stderr[-3000:]
    assert "no training progress" not in r.stderr
