"""The trainer: components that own their state, side duties as callbacks, and fit().

    Trainer(cfg, resume="auto").fit()

Components: the Engine (megatok.train.engine: the model under DeepSpeed, optimizer, schedule), the
DataStream (data_stream: this rank's batches and their position), the Checkpointer (checkpointer: resume
choice, set-aside, save) and TrainMetrics (metrics: the rows' figures, cumulative bytes and FLOPs).
Callbacks (callbacks) do the side duties: watchdog, stop requests, profiler window, metrics rows and
console, and evaluation (evaluation.Evaluation: validation, head-to-head, what a stop left pending).
A checkpoint's megatok.json holds each component's ``state_dict()``, and each stateful callback's, under
its own key ("engine", "data", "metrics", "evaluation"); a resume gives each its part alone. It runs the
real DeepSpeed engine on any number of ranks (gloo on CPU, nccl on GPU). Randomness that matters for the
result (boundary sampling) is seeded from (seed, step, micro-batch index), so a resumed run and a run
with a different rank/accumulation split draw the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as tdist

from megatok.config import Config, lr_lambda
from megatok.data.encoding import encoding_for
from megatok.devices import deterministic_kernels
from megatok.dsconfig import builds_partitioned, deepspeed_config
from megatok.metrics import MetricsLogger
from megatok.train import dist, peers
from megatok.train.callbacks import Callback, LogMetrics, Profile, StopRequest, Watchdog
from megatok.train.checkpointer import Checkpointer, Start
from megatok.train.data_stream import DataStream
from megatok.train.engine import Engine, build
from megatok.train.evaluation import Evaluation
from megatok.train.metrics import TrainMetrics
from megatok.train.warm_start import warm_start


def step_seed(seed: int, step: int, index: int) -> int:
    """The torch seed for micro-batch ``index`` (= micro_step * world + rank) of optimizer step ``step``."""
    return ((seed * 1_000_003 + step) * 10_007 + index) % (2**63)


class Trainer:
    """Starts the process group, builds the components and resumes them (``resume``: "auto", the latest
    checkpoint of the run directory, if any; "none"; or a checkpoint tag). ``callbacks`` run after the
    trainer's own. The run directory has one writer: a start while another run holds it fails with
    RunDirInUse naming that run, or waits up to ``lock_wait_s`` seconds for it to end."""

    def __init__(self, cfg: Config, *, resume: str = "auto", callbacks: Sequence[Callback] = (),
                 lock_wait_s: float = 0.0):
        t = cfg.train
        self.cfg, self.max_steps, self.log_every = cfg, t.max_steps, t.log_every
        if t.deterministic:
            deterministic_kernels()  # before any kernel runs
        self.device = dist.init(t.collective_timeout_s)
        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        peers.gather(self.rank, self.world)  # who is who, for the line a rank that loses contact ends with
        ds_config = deepspeed_config(cfg, self.world)
        self.checkpointer = Checkpointer(t, self.rank)
        self.start = self.checkpointer.start(cfg, resume, ds_config, lock_wait_s)  # collective; may convert
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        encoding = encoding_for(cfg)
        model = build(cfg, ds_config, self.device)
        if t.init_from is not None and not self.start.tag:
            said = warm_start(model, cfg)
            if self.rank == 0:
                print(f"megatok: {said}", flush=True)
        self.engine = Engine(model, ds_config, t, lr_lambda(cfg))
        self.data = DataStream(cfg, encoding, self.rank, self.world, self.device)
        self.evaluation = Evaluation(cfg, self.rank, self.world, encoding, self.device)
        self.metrics = TrainMetrics(cfg, self.device, self.world)
        lg = cfg.logging
        profile = [Profile(lg.profile_steps, Path(t.run_dir), self.rank, self.device)] if lg.profile_steps else []
        self.callbacks = [Watchdog(t.dist_timeout_s), StopRequest(Path(t.run_dir), self.rank), *profile,
                          LogMetrics(), self.evaluation, *callbacks]
        self.step, self.lr, self.stopping, self.stop_reason = 0, 0.0, False, None
        if self.start.tag:
            self.resume(self.start)
        self.checkpointer.set_aside(self.start)  # before the logger opens metrics.jsonl, which it rewrites
        self.data.open()
        try:
            self.logger = MetricsLogger(t.run_dir, enabled=self.rank == 0, total_steps=t.max_steps,
                                        start_step=self.step, wandb_mode=lg.wandb_mode,
                                        wandb_project=lg.wandb_project, wandb_entity=lg.wandb_entity,
                                        wandb_name=lg.wandb_name, config=cfg.to_dict(), progress=lg.progress,
                                        wandb_group=lg.wandb_group, wandb_tags=lg.wandb_tags,
                                        tensorboard=lg.tensorboard)
        except BaseException:
            self.data.close()  # its reader worker would outlive the failed start
            raise
        if self.rank == 0:
            self._announce()

    def fit(self) -> dict:
        """Train to train.max_steps, or until a stop request (checkpointed at that step). Returns the last
        training row ({} if none was logged), with "stopped": why, when a stop request ended the run.
        Whatever it raises (a step, a save, a callback) it re-raises after :meth:`abort`: no watchdog left
        to end the process later, the signal handlers restored, the data workers and the metrics file closed."""
        try:
            self._fire("on_fit_start")
            self.metrics.begin()
            self.engine.ds.train()
            while self.step < self.max_steps and not self.stopping:
                self._fire("on_step_begin")
                self.lr = self.engine.lr
                finite = self.train_step()
                self.step += 1
                self.stopping = self.agree(finite)
                self._fire("on_step_end")  # the metrics row, the evaluation
                if self.checkpointer.due(self.step) or self.step == self.max_steps or self.stopping:
                    self.save()
            self._fire("on_fit_end")
        except BaseException as e:
            self.abort(e)
            raise
        self.close()
        return {**self.metrics.last_row, **({"stopped": self.stop_reason} if self.stop_reason else {})}

    def train_step(self) -> torch.Tensor:
        """One optimizer step over train.grad_accum micro-batches; whether all their losses were finite."""
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        self.engine.begin_step(self.step)
        for micro in range(self.cfg.train.grad_accum):
            tokens = self.data.next_batch().to(self.device, non_blocking=True)  # pinned on a GPU: no sync
            torch.manual_seed(step_seed(self.cfg.train.seed, self.step, micro * self.world + self.rank))
            out = self.engine.forward(tokens)
            self.engine.backward(out.loss)
            finite &= self.metrics.add_output(out)
        return finite

    def agree(self, finite: torch.Tensor) -> bool:
        """One small collective per step: did any rank see a non-finite loss, or a stop request? The
        engine counts the updates DeepSpeed skipped (and gives up after too many). Returns whether to stop.
        Reading the answer is a device-to-host sync, once per step (tests/train/test_host_syncs.py counts
        megatok's)."""
        wants_stop = any(cb.stop_requested(self) for cb in self.callbacks)
        flags = torch.stack([(~finite).float(), torch.full((), float(wants_stop), device=self.device)])
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
        nonfinite, stopping = flags.tolist()
        try:
            skipped = self.engine.end_step(self.step, bool(nonfinite))
        except FloatingPointError as e:
            raise FloatingPointError(f"{e}; last good checkpoint: {self.checkpointer.last_good()}") from None
        self.metrics.add("skipped_steps", skipped)  # a host number: summed on the host
        return bool(stopping)

    @property
    def log_due(self) -> bool:
        return (self.step % self.log_every == 0 or self.checkpointer.due(self.step)
                or self.evaluation.due(self.step) or self.stopping)

    def save(self) -> None:
        self.progress(f"writing the step-{self.step} checkpoint", self.checkpointer.limit)
        with self.metrics.paused():
            self.checkpointer.save(self.engine, self.step, self.state_dict(), self.data.cursors)

    def progress(self, doing: str, limit: tuple[float, str] | None = None) -> None:
        """Tell the callbacks (the watchdog) what comes next and how long it may take."""
        self._fire("on_progress", doing, limit)

    def state_dict(self) -> dict:
        """Collective (the data position's epochs are agreed over the ranks): each component's state, and
        each stateful callback's, by its key in megatok.json (the checkpointer adds the step and the model)."""
        return {"engine": self.engine.state_dict(), "data": self.data.state_dict(),
                "metrics": self.metrics.state_dict(),
                **{cb.state_key: cb.state_dict() for cb in self.callbacks if cb.state_key}}

    def resume(self, start: Start) -> None:
        """Collective: DeepSpeed's states and, where the data layout is the same (the ranks go on as they
        would have), this rank's generators; then each component its part of the checkpoint
        (load_state_dict)."""
        self.checkpointer.load(self.engine, start, restore_rng=self.data.same_layout(start.meta["data"]))
        self.load_state_dict(start)

    def load_state_dict(self, start: Start) -> None:
        """Collective (rank 0 decides the data position for all ranks): each component's part of the
        checkpoint ``start`` resumes; the data stream reads its readers' cursors through ``start``. A
        stateful callback the checkpoint holds no part for keeps its fresh state."""
        meta = start.meta
        self.step = start.step
        self.engine.load_state_dict(meta["engine"])
        self.data.load_state_dict(meta["data"], start)
        self.metrics.load_state_dict(meta["metrics"])
        for cb in self.callbacks:
            if cb.state_key in meta:
                cb.load_state_dict(meta[cb.state_key])

    def close(self) -> None:
        try:
            self.data.close()
        finally:
            self.logger.close()
        if self.rank != 0:  # rank 0 releases the run directory last: a run waiting for it waits for all
            self.checkpointer.release_lock()
        dist.finish()
        if self.rank == 0:
            self.checkpointer.release_lock()
        peers.close()

    def abort(self, error: BaseException) -> None:
        """fit() raised ``error``: every callback's on_fit_error (the watchdog stops, the signal handlers
        are restored; each runs even when one before it raised), then the data stream and the logger
        close (a wandb run is marked failed). What fails here is noted on ``error``, which fit() re-raises.
        The process group stays up: a barrier now would wait on ranks that may still be in a collective
        (launch/pretrain.py ends the process; an in-process caller may start another Trainer)."""
        duties = [(f"{type(cb).__name__}.on_fit_error", lambda cb=cb: cb.on_fit_error(self, error))
                  for cb in self.callbacks]
        duties += [("closing the data stream", self.data.close),
                   ("closing the metrics logger", lambda: self.logger.close(failed=True))]
        for what, duty in duties:
            try:
                duty()
            except Exception as e:  # noqa: BLE001 - the error that ended the fit is the one to report
                error.add_note(f"megatok: then, {what}: {type(e).__name__}: {e}")

    def _fire(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _announce(self) -> None:
        cfg, start, engine = self.cfg, self.start, self.engine
        built = " (built partitioned)" if builds_partitioned(cfg) else ""
        precision = "bf16" if engine.ds.bfloat16_enabled() else "fp32"
        print(f"megatok: {engine.n_params:,} parameters, {self.world} rank(s), device {self.device.type}, "
              f"ZeRO stage {engine.zero_stage}{built}, {precision}"
              f"{', torch.compile (the first steps compile)' if cfg.train.compile else ''}, "
              f"start step {self.step}{f' from {start.tag}' if start.tag else ''}, run dir {cfg.train.run_dir}",
              flush=True)
        if self.step >= self.max_steps:
            print(f"megatok: {start.tag} is at step {self.step} and train.max_steps is {self.max_steps}: nothing "
                  f"to train (raise train.max_steps to go on)", flush=True)


def train(cfg: Config, *, resume: str = "auto", lock_wait_s: float = 0.0) -> dict:
    """Trainer(cfg, resume=resume, lock_wait_s=lock_wait_s).fit(): what launch/pretrain.py runs."""
    return Trainer(cfg, resume=resume, lock_wait_s=lock_wait_s).fit()
