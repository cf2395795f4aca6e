"""Build a config's model the way the trainer does under ZeRO-3 (deepspeed.zero.Init, each module
partitioned over the ranks as soon as it is built) and as a plain whole model, on CPU ranks, and
report, per boundary strategy:

- the peak host memory (RSS) each build adds on a rank;
- whether the partitioned model, gathered one parameter at a time, equals the plain build bit for
  bit (same seed). A strategy that writes to a child's parameters in its ``__init__`` without
  ``megatok.boundaries.base.initialise`` fails here: ZeRO-3 would have silently skipped that write.

    megatok-zero-init-check --config configs/1b.json --set deepspeed.bf16.enabled=false
    megatok-zero-init-check --config configs/tiny.json --strategies policy,hnet,gumbel --ranks 2

It launches ``--ranks`` processes with torchrun (gloo, one thread each), each running this module
(``python -m megatok.perf.zero_init SETTINGS``, the check's settings as one JSON object). Peak RSS
is the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs before each build) minus
the RSS before it, with glibc told to return every block of 64 KiB or more to the OS
(MALLOC_MMAP_THRESHOLD_), so it follows live tensors. Exit status 1 if any build differs.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from megatok.config import load_config
from megatok.dsconfig import deepspeed_config
from megatok.model import build_model
from megatok.train import dist
from megatok.train.dist import free_port
from megatok.train.engine import build, full_shape

MIB = 2**20


def rss(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measured(fn):
    """(fn(), bytes of RSS the call added at its peak)."""
    gc.collect()  # free the previous builds first (ZeRO-3 parameters sit in reference cycles)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = rss("VmRSS")
    out = fn()
    return out, rss("VmHWM") - before


def worker(config: str, overrides: list[str], strategies: list[str] | None, no_compare: bool = False) -> int:
    """One rank of the check (started by torchrun): every strategy's model built both ways, the table
    printed by rank 0; 1 if any build differs, else 0."""
    import deepspeed
    import torch
    import torch.distributed as tdist
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel("WARNING")
    dist.init(120)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    rows, bad = [], 0
    for strategy in strategies or [None]:
        sets = overrides + ["deepspeed.zero_optimization.stage=3", "train.zero_init=true"]
        if strategy:
            sets.append(f"boundary.strategy={strategy}")
        cfg = load_config(config, sets, world_size=world)
        ds = deepspeed_config(cfg, world)
        torch.manual_seed(cfg.train.seed)
        zero, zero_peak = measured(lambda: build(cfg, ds))
        n_params = sum(full_shape(p).numel() for p in zero.parameters())
        differ = None
        plain_peak = 0
        if not no_compare:
            torch.manual_seed(cfg.train.seed)
            plain, plain_peak = measured(lambda: build_model(cfg))
            plain_params = dict(plain.named_parameters())
            differ = []
            for name, p in zero.named_parameters():
                with deepspeed.zero.GatheredParameters([p]):
                    if not torch.equal(p.data, plain_params[name].data.to(p.dtype)):
                        differ.append(name)
            plain_buffers = dict(plain.named_buffers())
            differ += [name for name, b in zero.named_buffers() if not torch.equal(b, plain_buffers[name])]
            bad += bool(differ)
            del plain, plain_params, plain_buffers
        peaks = torch.tensor([zero_peak, plain_peak], dtype=torch.float64)
        tdist.all_reduce(peaks, op=tdist.ReduceOp.MAX)
        name = "bpe_lm" if cfg.model.kind == "bpe" else strategy or cfg.boundary.strategy
        rows.append((name, n_params, *peaks.tolist(), differ))
        del zero
    if rank == 0:
        precision = "bf16" if deepspeed_config(cfg, world).get("bf16", {}).get("enabled") else "fp32"
        print(f"{config}, {world} ranks, {precision}; peak host RSS a build adds on a rank (max over ranks):")
        print(f"{'strategy':<12} {'params':>14} {'zero.Init MiB':>14} {'plain MiB':>10}  weights")
        for name, n, zp, pp, differ in rows:
            verdict = "not compared" if differ is None else "identical" if not differ else \
                f"DIFFER: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}"
            plain = "-" if differ is None else f"{pp / MIB:,.0f}"
            print(f"{name:<12} {n:>14,} {zp / MIB:>14,.0f} {plain:>10}  {verdict}")
        sys.stdout.flush()
    dist.finish()
    return 1 if bad else 0


def check(config: str, overrides: list[str], strategies: list[str] | None, ranks: int,
          no_compare: bool = False) -> int:
    """The check on ``ranks`` CPU ranks: ``worker`` of these settings on each (this module under
    torchrun); 1 if a build differs or the workers fail, else 0. A config or strategy that does not load
    is a ConfigError, before any process starts."""
    for strategy in strategies or [None]:
        load_config(config, overrides + ([f"boundary.strategy={strategy}"] if strategy else []), world_size=ranks)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(free_port()), "--module", "megatok.perf.zero_init"]
    settings = {"config": config, "overrides": overrides, "strategies": strategies, "no_compare": no_compare}
    rc = subprocess.run(torchrun + [json.dumps(settings)], env=env).returncode
    if rc:
        print(f"error: {config}: the ZeRO-3 build differs from the plain build or failed (exit {rc}); see above",
              file=sys.stderr)
    return 1 if rc else 0


if __name__ == "__main__":  # one rank of check(), started by torchrun
    code = worker(**json.loads(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after zero.Init, gloo's C++ objects sometimes abort in their destructors
    # ("terminate called without an active exception", 1 run in 7 here) once all work is done and reported.
    os._exit(code)
