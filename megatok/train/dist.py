"""Process-group set-up for DeepSpeed on GPUs (nccl) and CPUs (gloo)."""

from __future__ import annotations

import errno
import os
import random
import socket
import sys
import threading
import time
from datetime import timedelta

import torch


def _bindable(port: int) -> bool:
    """Whether ``port`` is free on every IPv4 and every IPv6 interface: torch's store binds both."""
    held = []
    try:
        for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
            try:
                s = socket.socket(family)
            except OSError:  # IPv6 switched off on this machine
                continue
            held.append(s)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 side is checked above
            try:
                s.bind((host, port))
            except OSError as e:
                if family == socket.AF_INET or e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
        return True
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """A free TCP port for a rendezvous, chosen at random below the kernel's ephemeral range: the port is
    released before the store binds it, and a port the kernel hands out itself (to any connection on
    the machine, e.g. another job's ranks) could be taken in between."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    rng, top = random.SystemRandom(), min(first_ephemeral, 30000)  # 30000-32767: Kubernetes node ports
    for _ in range(100 if top > 12000 else 0):
        port = rng.randrange(10000, top)
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ensure_launch_env() -> None:
    """A plain ``python launch/pretrain.py`` is a world of one: give it what a launcher would set."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(timeout_s: float) -> torch.device:
    """Start the process group; returns this rank's device: a GPU (nccl) where DeepSpeed's accelerator
    is CUDA, else the CPU (gloo). DeepSpeed places the model on its accelerator's device, so the data
    and the collectives follow it, not torch.cuda.is_available(): DS_ACCELERATOR=cpu on a machine with
    GPUs (as the tests set) runs wholly on the CPU."""
    ensure_launch_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    on_gpu = get_accelerator().device_name() == "cuda"
    if not on_gpu and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU must split its cores; the deepspeed launcher does not set this.
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", os.environ["WORLD_SIZE"])))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    # The shared-memory all-reduce op serves only inference and would compile C++ for a minute on CPU.
    deepspeed.ops.__compatible_ops__ = {}
    timeout = timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", timeout=timeout, verbose=False)
    groups_inherit_timeout(timeout)
    if on_gpu:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def groups_inherit_timeout(timeout: timedelta) -> None:
    """Every process group created from now on in this process gets ``timeout`` unless its creator says
    otherwise. The timeout given to init_process_group is the default group's only: DeepSpeed runs ZeRO's
    gradient reductions and parameter gathers on its own copy of the world group (``new_group(ranks)``,
    no timeout), and torch gives such a group its backend's default, 10 minutes on NCCL (30 on gloo).
    torch reads that default from these two module attributes at each ``new_group``."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def address_in_use(exc: BaseException) -> bool:
    """Whether the process group could not start because its rendezvous port (MASTER_PORT) is taken."""
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


_COMM_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                  "nccl error", "gloo/transport")


def is_comm_failure(exc: BaseException) -> bool:
    """Whether an exception is a collective that lost its peer (died, hung, killed), not a bug."""
    import torch.distributed as tdist

    if isinstance(exc, getattr(tdist, "DistError", ())):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _COMM_FAILURES)


class Watchdog:
    """Ends this rank when the training loop stops making progress for ``timeout_s`` seconds.

    A rank that dies or hangs leaves the others blocked in a collective, and a collective's timeout
    does not cover what runs outside collectives (a hung data reader, a rank stuck before it reaches
    the next collective). The loop calls ``beat(doing)`` at every step, evaluation and checkpoint; if no
    beat comes in time, this prints one clear line, naming what this rank was doing and the config key that bounds it,
    and exits the process, so the launcher ends the job. Never an endless wait. A beat may allow the next
    piece of work another limit than ``timeout_s`` (a checkpoint save: ``train.save_timeout_s``)."""

    def __init__(self, timeout_s: float, describe, key: str = "train.dist_timeout_s"):
        self.describe, self.default = describe, (timeout_s, key)
        # (when, what, (seconds, config key)): one tuple, so the watching thread never sees half a beat
        self.state = (time.monotonic(), "starting", self.default)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="megatok-watchdog", daemon=True)
        self.thread.start()

    def beat(self, doing: str = "training", limit: tuple[float, str] | None = None) -> None:
        """Progress: what comes next, and (seconds, config key) it may take if not the default timeout."""
        self.state = (time.monotonic(), doing, limit or self.default)

    def stop(self) -> None:
        """No more watching: the thread has ended when this returns."""
        self.stopped.set()
        if self.thread is not threading.current_thread():
            self.thread.join()

    def _watch(self) -> None:
        while not self.stopped.wait(min(1.0, self.default[0] / 4)):
            last, doing, (timeout_s, key) = self.state
            idle = time.monotonic() - last
            if idle > timeout_s:
                print(f"error: rank {os.environ.get('RANK', '0')}: no training progress for {idle:.0f} s "
                      f"({key}={timeout_s:g}) while {doing}: a rank died, hung or was killed, or {doing} "
                      f"takes longer than that (then raise {key}); stopping the job; {self.describe()}",
                      file=sys.stderr, flush=True)
                os._exit(4)


def sum_over_ranks(values: dict[str, torch.Tensor], device) -> dict[str, float]:
    """One all-reduce for a dict of scalars (every rank must pass the same keys)."""
    import torch.distributed as tdist

    keys = sorted(values)
    t = torch.stack([values[k].to(device, torch.float64) for k in keys])
    tdist.all_reduce(t)
    return dict(zip(keys, t.tolist()))
