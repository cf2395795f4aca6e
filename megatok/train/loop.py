"""The training loop: build, then (batch -> forward -> losses -> backward -> step -> log -> eval -> save).

It runs the real DeepSpeed engine on any number of ranks (gloo on CPU, nccl on GPU): ZeRO stage,
bf16, accumulation and clipping come from the config's ``deepspeed`` and ``train`` sections.
Randomness that matters for the result (boundary sampling) is seeded from (seed, step, micro-batch
index), so a resumed run and a run with a different rank/accumulation split draw the same samples.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as tdist

from megatok.config import Config, lr_lambda
from megatok.dsconfig import builds_partitioned, deepspeed_config, zero_stage
from megatok.data.encoding import encoding_for
from megatok.data.stream import PackedByteStream, make_loader, resolve_sources
from megatok.eval.head_to_head import HeadToHead
from megatok.flops import device_peak_tflops, flops_per_byte
from megatok.metrics import MetricsLogger
from megatok.model import build_model
from megatok.model.blocks import Block, compile_blocks
from megatok.run import same_model
from megatok.stats import ratios
from megatok.train import checkpoint, dist, faults
from megatok.train.dist import sum_over_ranks
from megatok.train.position import (StreamPosition, all_cursors, by_source, data_digests, data_matches, data_position,
                                    layout, layout_matches)
from megatok.train.validation import validate, validation_batches

LOSS_TERMS = ("loss", "lm_loss", "policy_loss", "rate_loss")


def step_seed(seed: int, step: int, index: int) -> int:
    """The torch seed for micro-batch ``index`` (= micro_step * world + rank) of optimizer step ``step``."""
    return ((seed * 1_000_003 + step) * 10_007 + index) % (2**63)


def build(cfg: Config, ds_config: dict, device: torch.device | None = None) -> torch.nn.Module:
    """The model, built under ``deepspeed.zero.Init`` for ZeRO-3 (unless train.zero_init is off): each
    module is partitioned over the ranks as soon as it is built, so no rank, and no host, ever holds
    the whole model. The random draws are those of a plain build (tests/train/test_zero_init.py); on a
    GPU they are made on the device. Under ZeRO 0-2 every rank holds the whole working copy anyway: on
    a GPU it is built there directly (fp32, then cast by the engine), not on the host first, so a node
    needs no host RAM for 8 whole fp32 models at start-up."""
    import deepspeed

    if builds_partitioned(cfg):
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model(cfg)
    elif device is not None and device.type != "cpu":
        with torch.device(device):
            model = build_model(cfg)
    else:
        model = build_model(cfg)
    if cfg.train.compile:
        compile_model(model, cfg)
    return model


def compile_model(model: torch.nn.Module, cfg: Config) -> int:
    """train.compile: every transformer block through torch.compile (megatok.model.blocks.compile_blocks).
    Under ZeRO-3 each block is first made a ZeRO-3 leaf module, before the engine puts its hooks on
    the model: its parameters are gathered in one hook around the block instead of one per layer
    inside it, where every hook would split the compiled block into per-layer graphs (on the tiny test
    model, 43 recompilations and graph breaks in DeepSpeed's hooks, against 3 and none: the count
    under ZeRO-2). Returns how many blocks."""
    if zero_stage(cfg) == 3:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [Block])
    return compile_blocks(model)


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape, also when ZeRO-3 has partitioned it (its data is then an empty tensor)."""
    return getattr(p, "ds_shape", p.shape)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases or the policy's scalar bias)."""
    decay = [p for p in model.parameters() if len(full_shape(p)) >= 2]
    rest = [p for p in model.parameters() if len(full_shape(p)) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def interval_flops(cfg: Config, s: dict[str, float]) -> float:
    """Model FLOPs (megatok.flops, training = 3 x forward) of the positions a log interval processed,
    at the realised rate: chunks per position for the byte model, tokens per byte for the token model."""
    if cfg.model.kind == "bpe":
        return flops_per_byte(cfg, rate=s["positions"] / max(1.0, s["targets"]))["training"] * s["targets"]
    return flops_per_byte(cfg, rate=s["chunks"] / max(1.0, s["positions"]))["training"] * s["positions"]


class Totals:
    """Per-log-interval sums kept on the device (one host sync per logged step, not per micro-batch).
    Micro-batches with a non-finite loss are counted, not averaged in."""

    def __init__(self, device):
        self.device, self.sums = device, {}

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().to(self.device, torch.float64)
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def add_output(self, out) -> torch.Tensor:
        finite = torch.isfinite(out.loss.detach())
        keep = finite.double()
        for k in LOSS_TERMS:
            v = out.loss if k == "loss" else out.terms.get(k, torch.zeros((), device=self.device))
            self.add(k, torch.where(finite, v.detach().double(), 0.0))
        for k, v in out.stats.items():
            self.add(k, torch.nan_to_num(v) * keep)
        self.add("micro_batches", keep)
        self.add("nonfinite_losses", 1 - keep)
        return finite

    def all_sum(self) -> dict[str, float]:
        sums, self.sums = sum_over_ranks(self.sums, self.device), {}
        return sums


class StopRequest:
    """SIGTERM/SIGINT (a scheduler's pre-emption, Ctrl-C), or a file RUN_DIR/STOP (or the file the
    environment variable MEGATOK_STOP_FILE names: the Slurm template's time-limit trap touches it),
    asks for a checkpoint and a clean exit at the end of the current step. Ranks may see the request
    at different times; the loop agrees on stopping through a collective, so every rank stops at the
    same step and the checkpoint is complete. The file works with any launcher and from any machine
    that sees it; rank 0 alone looks for it (the collective tells the others) and removes it once the
    run has stopped."""

    def __init__(self, run_dir: Path, rank: int):
        self.signalled, self.rank = False, rank
        self.files = [run_dir / "STOP"] + ([Path(os.environ["MEGATOK_STOP_FILE"])]
                                           if os.environ.get("MEGATOK_STOP_FILE") else [])
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        self.signalled = True

    def _file(self) -> Path | None:
        return next((f for f in self.files if f.exists()), None)

    @property
    def requested(self) -> bool:
        return self.signalled or (self.rank == 0 and self._file() is not None)

    def reason(self) -> str:
        found = None if self.signalled else self._file()
        return f"stopped by {found}" if found else "stopped by signal"

    def remove_files(self) -> None:
        for f in self.files:
            f.unlink(missing_ok=True)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _row_step(line: str) -> float:
    """A metrics row's step; a row cut short by a kill counts as after every step."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return math.inf


def set_aside_abandoned(run_dir: Path, step: int, fresh: bool, previous_config: str | None = None) -> Path | None:
    """Rank 0 at start, resuming from ``step`` (0: a fresh start). Checkpoints after ``step`` belong to
    a trajectory this run abandons (it resumes from an earlier checkpoint, or starts over in a used
    directory): they move, with the metrics rows after ``step``, into RUN_DIR/superseded-<time>/, so
    nothing is lost and the live directory holds one trajectory (``keep_checkpoints`` prunes only it,
    ``latest`` names the resumed checkpoint). Returns that directory. Otherwise the rows after ``step``
    are replays of what the resumed run is about to redo, and are dropped; a fresh start keeps every
    earlier row aside too. The set-aside directory keeps ``previous_config`` (the config.json this start
    replaced) as its config.json."""
    later = [t for t in checkpoint.published_tags(run_dir) if int(t.removeprefix("step")) > step]
    path = run_dir / "metrics.jsonl"
    rows = [line for line in path.read_text().splitlines(keepends=True) if line.strip()] if path.is_file() else []
    keep, after = [], []
    for line in rows:
        (after if fresh or _row_step(line) > step else keep).append(line)
    aside = None
    if later or (fresh and rows):
        aside = run_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        while aside.exists():
            aside = aside.with_name(aside.name + "+")
        (aside / checkpoint.CHECKPOINTS).mkdir(parents=True)
        (aside / "metrics.jsonl").write_text("".join(after))
        if previous_config is not None:
            (aside / "config.json").write_text(previous_config)
        # ``latest`` first: killed halfway, the next start resumes from it and moves the rest.
        checkpoint.set_latest(run_dir, checkpoint.tag_for(step) if step else None)
        for tag in later:
            os.replace(checkpoint.checkpoint_dir(run_dir) / tag, aside / checkpoint.CHECKPOINTS / tag)
    if after:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return aside


def train(cfg: Config, *, resume: str = "auto") -> dict:
    """Run training as configured. ``resume``: "auto" (latest checkpoint of the run directory, if any),
    "none", or a checkpoint tag. Returns the last logged training row (rank 0; {} elsewhere), with
    "stopped": why, when a signal or RUN_DIR/STOP ended the run early."""
    import deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    device = dist.init(cfg.train.collective_timeout_s)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    run_dir = Path(cfg.train.run_dir)
    choice = [None, None]  # rank 0 picks the checkpoint for all ranks (their views of a filesystem may lag)
    shapes = same_model.model_shapes(cfg)  # recorded in every checkpoint: a resume must build the same model
    files = same_model.model_files(cfg)  # ... and read the same tokenizer
    previous_config = None  # the config.json a set-aside trajectory keeps
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_stale(run_dir)
        try:
            choice[0] = None if resume == "none" else checkpoint.resume_tag(run_dir, resume)
            if choice[0]:
                same_model.check_same_model(run_dir, choice[0], cfg)
        except checkpoint.CheckpointError as e:
            choice[1] = str(e)
        if not choice[1]:  # a refused start leaves the run's config.json as it was
            if (run_dir / "config.json").is_file():
                previous_config = (run_dir / "config.json").read_text()
            cfg.dump(run_dir / "config.json")
    tdist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise checkpoint.CheckpointError(choice[1])
    tag = choice[0]
    meta = checkpoint.read_meta(run_dir, tag) if tag else None
    same_layout = meta is None or layout_matches(meta["layout"], cfg, world)
    digests = data_digests(cfg)
    same_data = meta is not None and data_matches(meta, digests)
    if meta is not None and same_layout and not same_data and rank == 0:
        print(f"megatok: warning: {tag} was trained on other shards or another tokenizer than data.shards / "
              f"model.tokenizer now give (shard list, sizes or encoding changed): the data position is resumed "
              f"as recorded, so documents may be repeated or skipped", flush=True)
    ds_config = deepspeed_config(cfg, world)
    if not same_layout and meta["layout"]["world_size"] != world:
        tag = checkpoint.universal(run_dir, tag, ds_config)  # re-partition ZeRO states for the new world size

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    encoding = encoding_for(cfg)
    model = build(cfg, ds_config, device)
    n_params = sum(full_shape(p).numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=param_groups(model, cfg.train.weight_decay),
                                           lr_scheduler=lambda opt: LambdaLR(opt, lr_lambda(cfg)))
    if tag:
        checkpoint.load(engine, run_dir, tag, restore_rng=same_layout)
        # The config's learning rate wins over the one saved in the scheduler state, from the next update on.
        sched = engine.lr_scheduler
        sched.base_lrs = [cfg.train.lr] * len(sched.base_lrs)
        factor = lr_lambda(cfg)(max(0, sched.last_epoch))
        for group in engine.optimizer.param_groups:
            group["lr"] = cfg.train.lr * factor
        if rank == 0 and tag.startswith("universal-"):
            shutil.rmtree(checkpoint.checkpoint_dir(run_dir) / tag, ignore_errors=True)  # a derived copy
    if rank == 0:
        aside = set_aside_abandoned(run_dir, meta["step"] if meta else 0, fresh=meta is None,
                                    previous_config=previous_config)
        if aside:
            where = f"resuming from step {meta['step']}" if meta else "starting from step 0"
            print(f"megatok: {where}; the later checkpoints and metrics are kept in {aside}", flush=True)
    step = meta["step"] if meta else 0
    sources, weights = resolve_sources(cfg.data.shards, "train")
    # Same layout and data: each reader continues from its cursor. Checkpoints from before cursors, and
    # other shards (whose indices the cursors do not describe), regenerate the recorded number of batches.
    # Another layout on the same data shares out what the old readers had not read of the current epoch.
    # Rank 0 decides where the stream starts, for all ranks.
    stream_start = [None]
    if rank == 0:
        old_cursors = all_cursors(run_dir, meta, len(sources)) if not same_layout and same_data else {}
        stream_start[0] = data_position(meta, cfg, world, old_cursors, list(map(len, sources)), same_data)
    tdist.broadcast_object_list(stream_start, src=0)
    start_batch, start_epochs, stream_origin = stream_start[0]
    cursors = checkpoint.read_cursors(run_dir, meta["tag"], rank, len(sources)) if (
        start_batch and same_layout and same_data) else {}
    accum = cfg.train.grad_accum

    stream = PackedByteStream(sources if weights else sources[0], weights=weights, seq_len=cfg.data.seq_len,
                              batch_size=cfg.train.micro_batch_size, rank=rank, world_size=world,
                              seed=cfg.train.seed, start_batch=start_batch, start_epoch=start_epochs,
                              on_bad_shard=cfg.data.on_bad_shard, encoding=encoding, cursors=cursors,
                              unread=stream_origin.get("unread"))
    batches = iter(make_loader(stream, cfg.data.num_workers))
    if start_batch:  # a resume: the readers seek to their cursors (or regenerate), before the watchdog
        t = time.time()
        batches = itertools.chain([next(batches)], batches)
        if rank == 0:
            how = "at its readers' cursors" if cursors else f"by regenerating {start_batch} batches per rank"
            print(f"megatok: data stream resumed {how} in {time.time() - t:.1f} s", flush=True)
    val = validation_batches(cfg, rank, world, encoding)
    h2h = HeadToHead(cfg, rank, world) if cfg.eval.head_to_head else None
    # cumulative text bytes (UTF-8 bytes predicted) and model FLOPs, carried across resumes
    bytes_seen, flops_seen = (meta.get("bytes_seen", 0.0), meta.get("flops", 0.0)) if meta else (0.0, 0.0)

    logger = MetricsLogger(run_dir, enabled=rank == 0, total_steps=cfg.train.max_steps, start_step=step,
                           wandb_mode=cfg.logging.wandb_mode, wandb_project=cfg.logging.wandb_project,
                           wandb_entity=cfg.logging.wandb_entity, wandb_name=cfg.logging.wandb_name,
                           config=cfg.to_dict(), progress=cfg.logging.progress)
    if rank == 0:
        built = " (built partitioned)" if builds_partitioned(cfg) else ""
        precision = "bf16" if engine.bfloat16_enabled() else "fp32"
        print(f"megatok: {n_params:,} parameters, {world} rank(s), device {device.type}, "
              f"ZeRO stage {engine.zero_optimization_stage()}{built}, {precision}"
              f"{', torch.compile (the first steps compile)' if cfg.train.compile else ''}, "
              f"start step {step}{f' from {tag}' if tag else ''}, run dir {run_dir}", flush=True)
        if step >= cfg.train.max_steps:
            print(f"megatok: {tag} is at step {step} and train.max_steps is {cfg.train.max_steps}: nothing to "
                  f"train (raise train.max_steps to go on)", flush=True)

    def evaluate(at_step: int) -> None:
        validate(engine, cfg, val, device, at_step, logger)
        if h2h is not None:
            h2h.run(engine, at_step, device, logger, bytes_seen=bytes_seen)
        engine.train()

    watchdog = dist.Watchdog(cfg.train.dist_timeout_s,
                             lambda: f"last good checkpoint: {checkpoint.last_good(run_dir)}")
    if meta and meta.get("eval_pending"):  # a stop request ended the run at an evaluation step before it ran
        watchdog.beat(f"evaluating step {step} (left pending by the stop)")
        evaluate(step)
        if rank == 0:  # once: a rerun of a finished run must not log it again
            checkpoint.mark_evaluated(run_dir, meta["tag"])
    stop = StopRequest(run_dir, rank)
    save_limit = (cfg.train.save_timeout_s, "train.save_timeout_s") if cfg.train.save_timeout_s else None
    totals = Totals(device)
    # a streak of skipped steps goes on across a resume, as it would have without the stop
    skipped_in_row, t_last, paused, last_row = (meta or {}).get("skipped_in_row", 0), time.monotonic(), 0.0, {}
    peak_tflops = cfg.train.peak_tflops or device_peak_tflops(device)
    if not start_batch:  # a fresh stream: a reader nothing has been consumed from yet is at its start
        workers = max(1, cfg.data.num_workers)
        cursors = {r: {**stream.start_state(r)[0], "offset": 0} for r in range(rank * workers, (rank + 1) * workers)}
    position = StreamPosition(start_epochs, cursors)
    engine.train()
    while step < cfg.train.max_steps:
        watchdog.beat(f"training step {step + 1}")
        faults.maybe_hang(step + 1)
        faults.maybe_oom(step + 1)
        lr, skipped_before = engine.get_lr()[0], engine.skipped_steps
        finite = torch.ones((), dtype=torch.bool, device=device)
        for micro in range(accum):
            batch = next(batches)
            position.update(batch)
            tokens = batch["tokens"].to(device)
            torch.manual_seed(step_seed(cfg.train.seed, step, micro * world + rank))
            if cfg.model.kind == "unet":
                engine.module.boundary.step = step  # for strategies with schedules
            out = engine(tokens[:, :-1], tokens[:, 1:])
            if faults.nan_loss(step + 1):
                out.loss = out.loss * float("nan")
            engine.backward(out.loss)
            engine.step()  # DeepSpeed updates only at the accumulation boundary
            finite &= totals.add_output(out)
        step += 1

        # One small collective per step: did any rank see a non-finite loss, or get a stop signal?
        flags = torch.stack([(~finite).float(), torch.tensor(float(stop.requested), device=device)])
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
        nonfinite, stopping = flags.tolist()
        # DeepSpeed (ZeRO 1-3) skips an update whose global gradient norm is not finite: count it, and give up
        # after too many in a row. ZeRO-0 cannot skip, so there a non-finite loss stops the run before any save.
        skipped = engine.skipped_steps - skipped_before
        skipped_in_row = skipped_in_row + 1 if skipped else 0
        if nonfinite and engine.zero_optimization_stage() == 0:
            raise FloatingPointError(f"non-finite loss at step {step} under ZeRO stage 0, which cannot skip an "
                                     f"update; last good checkpoint: {checkpoint.last_good(run_dir)}")
        if skipped_in_row > cfg.train.max_skipped_steps:
            raise FloatingPointError(f"{skipped_in_row} optimizer steps in a row skipped for non-finite gradients "
                                     f"(train.max_skipped_steps={cfg.train.max_skipped_steps}) at step {step}; "
                                     f"last good checkpoint: {checkpoint.last_good(run_dir)}")
        totals.add("skipped_steps", torch.tensor(float(skipped)))

        last = step == cfg.train.max_steps
        eval_due = bool(cfg.eval.every and step % cfg.eval.every == 0) or last
        # (every checkpoint and evaluation step is logged too, so the cumulative bytes and FLOPs that a
        # checkpoint saves, and that the head-to-head matches its baseline by, are complete)
        if step % cfg.train.log_every == 0 or step % cfg.train.save_every == 0 or eval_due or stopping:
            totals.add("bad_shards", torch.tensor(float(position.bad_shards)))  # this rank's running count
            s = totals.all_sum()
            now = time.monotonic()
            n = s["micro_batches"] or float("nan")  # every micro-batch non-finite: the losses are NaN, not 0
            bytes_seen += s["targets"]
            interval = interval_flops(cfg, s)
            flops_seen += interval
            seconds = now - t_last - paused
            tflops = interval / seconds / world / 1e12  # model FLOP/s per device
            terms = LOSS_TERMS if cfg.model.kind == "unet" else ("loss", "lm_loss")
            last_row = {"step": step, "split": "train", **{k: s[k] / n for k in terms}, **ratios(s),
                        "lr": lr, "grad_norm": engine.get_global_grad_norm(),
                        "bytes_per_s": s["targets"] / seconds, "tflops_per_device": tflops,
                        **({"mfu": tflops / peak_tflops} if peak_tflops else {}),
                        "bytes_seen": bytes_seen, "flops": flops_seen,
                        "epoch": max(position.epochs), "bad_shards": int(s["bad_shards"]),
                        "nonfinite_losses": int(s["nonfinite_losses"]), "skipped_steps": int(s["skipped_steps"] / world)}
            last_row.update(by_source(cfg, position.epochs, "epochs"))  # rank 0's; the checkpoint's: all ranks
            logger.log(last_row)
            logger.progress(step, loss=last_row["loss"], bpb=last_row["bpb"],
                            **({"rate": last_row["boundary_rate"]} if "boundary_rate" in last_row else {}),
                            bytes_per_s=last_row["bytes_per_s"], **({"mfu": last_row["mfu"]} if "mfu" in last_row else {}))
            t_last, paused = now, 0.0

        t_pause = time.monotonic()
        if eval_due and not stopping:
            watchdog.beat(f"evaluating step {step}")
            evaluate(step)
        if step % cfg.train.save_every == 0 or last or stopping:
            watchdog.beat(f"writing the step-{step} checkpoint", save_limit)
            top = torch.tensor([float(e) for e in position.epochs], device=device)
            tdist.all_reduce(top, op=tdist.ReduceOp.MAX)
            top_epochs = [int(e) for e in top.tolist()]
            checkpoint.save(engine, run_dir, step, {"step": step, "epoch": max(top_epochs),
                                                   **by_source(cfg, top_epochs, "epochs"),
                                                   "stream_origin": stream_origin,
                                                   "eval_pending": eval_due and bool(stopping),
                                                   **digests,
                                                   "layout": layout(cfg, world), "bytes_seen": bytes_seen,
                                                   "zero_stage": engine.zero_optimization_stage(),
                                                   "param_shapes": shapes, "model_files": files,
                                                   "flops": flops_seen, "skipped_in_row": skipped_in_row},
                            keep=cfg.train.keep_checkpoints,
                            keep_every=cfg.train.keep_every, cursors=position.cursors)
        paused += time.monotonic() - t_pause
        if stopping:
            logger.log({"step": step, "split": "event", "event": stop.reason(),
                        "checkpoint": checkpoint.tag_for(step)})
            last_row = {**last_row, "stopped": stop.reason()}
            if rank == 0:
                stop.remove_files()  # else the resumed run would stop again at once
            break

    # The data workers end now, not at interpreter exit, where they would be waited for: they ignore
    # SIGTERM, and a reference left elsewhere to this frame (wandb keeps the exception of a failed init,
    # and with it the frames) would keep the loader alive past this return.
    batches = None
    watchdog.stop()
    stop.restore()
    logger.close()
    dist.finish()
    return last_row
