"""The training rows' figures: losses and boundary statistics summed over micro-batches and ranks,
throughput and model FLOP utilisation, and the cumulative bytes and FLOPs a run carries across resumes."""

from __future__ import annotations

import contextlib
import resource
import sys
import time

import torch
import torch.distributed as tdist

from megatok.config import Config
from megatok.flops import device_peak_tflops, flops_per_byte
from megatok.stats import ratios
from megatok.train.dist import sum_over_ranks

LOSS_TERMS = ("loss", "lm_loss", "policy_loss", "rate_loss")


def interval_flops(cfg: Config, s: dict[str, float]) -> float:
    """Model FLOPs (megatok.flops, training = 3 x forward) of the positions a log interval processed,
    at the realised rate: chunks per position for the byte model, tokens per byte for the token model."""
    if cfg.model.kind == "bpe":
        return flops_per_byte(cfg, rate=s["positions"] / max(1.0, s["targets"]))["training"] * s["targets"]
    return flops_per_byte(cfg, rate=s["chunks"] / max(1.0, s["positions"]))["training"] * s["positions"]


class Totals:
    """Per-log-interval sums: of tensors on the device, of host numbers on the host (one host sync per
    logged step, not per micro-batch, and no host-to-device copy before it). Micro-batches with a
    non-finite loss are counted, not averaged in."""

    def __init__(self, device):
        self.device, self.sums, self.host = device, {}, {}

    def add(self, key: str, value: torch.Tensor | float) -> None:
        if not isinstance(value, torch.Tensor):
            self.host[key] = self.host.get(key, 0.0) + float(value)
            return
        value = value.detach().to(self.device, torch.float64)
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add_output(self, out) -> torch.Tensor:
        finite = torch.isfinite(out.loss.detach())
        keep = finite.double()
        for k in dict.fromkeys([*LOSS_TERMS, *out.terms]):  # the strategy's own terms too (value_loss)
            v = out.loss if k == "loss" else out.terms.get(k, torch.zeros((), device=self.device))
            self.add(k, torch.where(finite, v.detach().double(), 0.0))
        for k, v in out.stats.items():
            self.add(k, torch.nan_to_num(v) * keep)
        self.add("micro_batches", keep)
        self.add("nonfinite_losses", 1 - keep)
        return finite

    def all_sum(self) -> dict[str, float]:
        host = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.host.items()}
        sums, self.sums, self.host = sum_over_ranks({**self.sums, **host}, self.device), {}, {}
        return sums


def peak_memory(device: torch.device) -> tuple[str, float]:
    """(row key, GiB): on a GPU the most memory torch allocated on it since the last call (its peak is
    reset here, so each training row has its interval's); on the CPU this process's peak resident set
    size since it started (getrusage's ru_maxrss, which cannot be reset)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return "gpu_peak_allocated_gib", peak / 2**30
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return "host_peak_rss_gib", maxrss * (1 if sys.platform == "darwin" else 1024) / 2**30


class TrainMetrics:
    """The interval sums (Totals), the interval's wall time less the time spent evaluating and
    checkpointing (``paused``), peak memory, and the cumulative text bytes (UTF-8 bytes predicted) and
    model FLOPs, which are its checkpointed state: the head-to-head matches a baseline's checkpoint by bytes."""

    def __init__(self, cfg: Config, device: torch.device, world: int):
        self.cfg, self.world, self.device = cfg, world, device
        self.totals = Totals(device)
        self.peak_tflops = cfg.train.peak_tflops or device_peak_tflops(device)
        self.bytes_seen = self.flops = 0.0
        self.t_last, self.t_paused = time.monotonic(), 0.0
        self.last_row: dict = {}

    def begin(self) -> None:
        """The first interval starts now (at the first step, after the set-up)."""
        self.t_last, self.t_paused = time.monotonic(), 0.0

    def add(self, key: str, value: torch.Tensor | float) -> None:
        """Add to this interval's sum of ``key``: a tensor (kept on the device) or a host number."""
        self.totals.add(key, value)

    def add_output(self, out) -> torch.Tensor:
        """Sum a micro-batch's losses and statistics; returns whether its loss is finite."""
        return self.totals.add_output(out)

    @contextlib.contextmanager
    def paused(self):
        """Time that does not count as training time in the throughput figures."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.t_paused += time.monotonic() - t0

    def row(self, step: int, **extra) -> dict:
        """Collective: the training row of the interval that ends at ``step`` (its figures summed over
        every rank, its peak memory the largest of any rank's: see peak_memory), with ``extra``
        (learning rate, grad norm, epochs) added; starts the next interval."""
        s = self.totals.all_sum()
        memory_key, gib = peak_memory(self.device)
        peak = torch.tensor([gib], dtype=torch.float64, device=self.device)
        tdist.all_reduce(peak, op=tdist.ReduceOp.MAX)
        now = time.monotonic()
        n = s["micro_batches"] or float("nan")  # every micro-batch non-finite: the losses are NaN, not 0
        interval = interval_flops(self.cfg, s)
        self.bytes_seen += s["targets"]
        self.flops += interval
        seconds = now - self.t_last - self.t_paused
        tflops = interval / seconds / self.world / 1e12  # model FLOP/s per device
        terms = [k for k in s if k.endswith("loss")] if self.cfg.model.kind == "unet" else ("loss", "lm_loss")
        self.last_row = {"step": step, "split": "train", **{k: s[k] / n for k in terms}, **ratios(s),
                         "lr": extra.pop("lr"), "grad_norm": extra.pop("grad_norm"),
                         "bytes_per_s": s["targets"] / seconds, "tflops_per_device": tflops,
                         **({"mfu": tflops / self.peak_tflops} if self.peak_tflops else {}),
                         memory_key: peak.item(), "bytes_seen": self.bytes_seen, "flops": self.flops, **extra,
                         "bad_shards": int(s["bad_shards"]), "nonfinite_losses": int(s["nonfinite_losses"]),
                         "skipped_steps": int(s["skipped_steps"] / self.world)}
        self.t_last, self.t_paused = now, 0.0
        return self.last_row

    def state_dict(self) -> dict:
        return {"bytes_seen": self.bytes_seen, "flops": self.flops}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_seen, self.flops = state["bytes_seen"], state["flops"]
