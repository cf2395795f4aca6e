"""What the trainer asks of a GPU between its kernels, checked on the CPU: the device-to-host reads megatok's
own code makes in a training step (each one a sync on a GPU: the host waits for the device's queue to
drain), and the tensors it makes from host data on the device, counted per step, so a new one fails
here; and the timeout of the process groups DeepSpeed
creates for ZeRO's collectives, which must be train.dist_timeout_s as the default group's is."""

import json

import pytest

from tests.conftest import TINY, python

pytestmark = pytest.mark.dist

SCRIPT = """
import collections, json, sys
from pathlib import Path

import torch
import torch.distributed as tdist

from megatok.config import load_config
from megatok.train.callbacks import Callback
from megatok.train.trainer import Trainer

PACKAGE = str(Path("megatok").resolve())
#: Tensor methods that read values on the host (a device-to-host copy: on a GPU the host waits for it)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
#: Functions that copy host data to a device when given one (a pageable copy: the host waits for it)
COPIES = ("tensor", "as_tensor")


class HostReads(Callback):
    \"\"\"Per optimizer step (from its start to its end, the metrics row and evaluation included when due),
    the reads of tensor values, and the tensors made from host data on a device, that megatok's own code
    makes, by place: a call from megatok/ itself, not from torch or DeepSpeed under it.\"\"\"

    def __init__(self):
        self.steps, self.saved = [], []

    def on_step_begin(self, trainer):
        self.count = collections.Counter()
        for name in READS:
            self._patch(torch.Tensor, name, lambda *args, **kwargs: True)
        for name in COPIES:
            self._patch(torch, name, lambda *args, device=None, **kwargs: device is not None)

    def _patch(self, owner, name, counts):
        call = getattr(owner, name)
        self.saved.append((owner, name, owner.__dict__.get(name)))

        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE) and counts(*args, **kwargs):
                where = Path(caller.co_filename).relative_to(Path(PACKAGE).parent)
                self.count[f"{where}:{caller.co_name} {name}"] += 1
            return call(*args, **kwargs)

        setattr(owner, name, counted)

    def on_step_end(self, trainer):
        for owner, name, saved in reversed(self.saved):
            if saved is None:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self.saved = []
        self.steps.append(dict(self.count))


def timeout_s(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


reads = HostReads()
trainer = Trainer(load_config("configs/tiny.json", sys.argv[1:]), resume="none", callbacks=[reads])
ds = trainer.engine.ds
timeouts = {"default group": timeout_s(tdist.group.WORLD), "deepspeed data parallel": timeout_s(ds.data_parallel_group),
            "zero optimizer": timeout_s(ds.optimizer.dp_process_group)}
trainer.fit()
print("RESULT " + json.dumps({"timeouts": timeouts, "steps": reads.steps}), flush=True)
"""

#: A metrics row's, at its steps only: the interval's sums over the ranks, the peak memory (a host number
#: on the device for the all-reduce, read back), and DeepSpeed's gradient norm (a tensor) as the row is written.
ROW = {"megatok/train/dist.py:sum_over_ranks tolist": 1, "megatok/train/metrics.py:row tensor": 1,
       "megatok/train/metrics.py:row item": 1, "megatok/metrics.py:_clean item": 1}
CASES = {
    "default": [],  # the main network's length read from the boundaries: one read per micro-batch
    # the length known in advance: none; and the policy's delayed start, whose latch (on or off) stays on the
    # device: none either
    "static capacity, start_margin": ["model.chunk_capacity=0.5", "model.static_chunks=true",
                                      "boundary.start_margin=0.0"],
}


def test_host_reads_per_step_and_the_timeout_of_deepspeeds_groups(shards, tmp_path):
    """Each place that reads a tensor on the host in a training step, and how often: chunk_layout reads the
    boundaries' counts once per micro-batch (K, the main network's length; none with a static chunk
    capacity; the policy's start_margin adds none) and agree() reads the ranks' answer once per step; the metrics row's reads (ROW) come only
    at its steps. A new read fails here: keep it off the step, or add it to this list with the reason it
    is needed. And DeepSpeed's own process groups, on which ZeRO reduces gradients, have
    train.dist_timeout_s (torch would give them its default: 30 minutes on gloo, 10 on NCCL)."""
    script = tmp_path / "reads.py"
    script.write_text(SCRIPT)
    accum = 2
    layout = {"megatok/model/chunking.py:chunk_layout tolist": accum}
    agree = {"megatok/train/trainer.py:agree tolist": 1}
    for case, want in (("default", {**layout, **agree}), ("static capacity, start_margin", agree)):
        r = python(script, *TINY, f"data.shards={shards}", "train.dist_timeout_s=77", "train.max_steps=4",
                   "train.log_every=3", "train.save_every=100", "train.micro_batch_size=2",
                   f"train.global_batch_size={2 * accum}", f"train.run_dir={tmp_path / case.replace(' ', '-').replace(',', '')}",
                   *CASES[case], timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        got = json.loads(r.stdout.split("RESULT ", 1)[1])
        assert got["timeouts"] == {"default group": 77.0, "deepspeed data parallel": 77.0, "zero optimizer": 77.0}
        steps = got["steps"]
        assert len(steps) == 4
        for step in (1, 2):  # no metrics row, no checkpoint, no evaluation: the training step alone
            assert steps[step - 1] == want, (case, step, steps[step - 1])
        assert steps[2] == {**want, **ROW}, (case, steps[2])  # step 3: a metrics row (train.log_every)
