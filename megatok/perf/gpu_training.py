"""The GPU check's training section (megatok.perf.gpu_check): bf16 training steps of a config on one
device, through the trainer's own engine (DeepSpeed) or the same step in plain torch, each config in a
spawned process of its own: step time, bytes/s, the realised boundary rate, model FLOP/s and MFU, peak
memory against megatok-model-size's estimate, the loss."""

from __future__ import annotations

import gc
import resource
import sysconfig
import time
from pathlib import Path

import torch

from megatok import flops, sizing
from megatok.config import load_config, lr_lambda
from megatok.data.stream import pack_documents
from megatok.dsconfig import deepspeed_config, uses_bf16, zero_stage
from megatok.model import build_model
from megatok.perf.plain_step import adamw, plain_step
from megatok.perf.timing import sync
from megatok.train import dist
from megatok.devices import deterministic_kernels
from megatok.train.engine import Engine, compile_model

GIB = 2**30


def text_sequences(seq_len: int, n: int) -> torch.Tensor:
    """[n, seq_len + 1] packed byte sequences of real text (stdlib sources, cycled if short)."""
    docs = [p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]
    seqs = pack_documents(docs, seq_len)[:-1]  # the last row is padded
    reps = -(-n // max(1, len(seqs)))
    return seqs.repeat(reps, 1)[:n]


def build(cfg, device: torch.device):
    """The config's model (megatok.model.build_model), built on the device, compiled as the trainer
    compiles it when train.compile is set."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = build_model(cfg)
    if cfg.train.compile:
        compile_model(model, cfg)
    return model


def train_check(config: str, overrides: list[str], *, device: torch.device, engine: str, steps: int, warmup: int,
                micro: int | None, peak: float | None) -> dict:
    sets = list(overrides) + ["logging.wandb_mode=disabled"]
    if micro:
        sets.append(f"train.micro_batch_size={micro}")
    base = load_config(config, sets, world_size=1)
    mb = base.train.micro_batch_size
    cfg = load_config(config, sets + ["train.grad_accum=1", f"train.global_batch_size={mb}"], world_size=1)
    if cfg.train.deterministic:  # this row's own process: the other rows keep the default kernels
        deterministic_kernels()
    T = cfg.data.seq_len
    data = text_sequences(T, mb * (steps + warmup)).view(steps + warmup, mb, T + 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    step, close = _stepper(model, cfg, engine, device)
    times, rates, losses = [], [], []
    for i in range(warmup + steps):
        x = data[i].to(device, non_blocking=True)
        torch.manual_seed(i)
        sync(device)
        t = time.perf_counter()
        out = step(x)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
        real = x[:, :-1] != 257
        rates.append(float(out.boundaries.starts[real].float().mean()))
        losses.append(float(out.loss.detach()))
    row = _training_row(cfg, config, engine, n_params, times, sum(rates[warmup:]) / max(1, len(rates[warmup:])),
                        losses, peak)
    if device.type == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 2)
    else:
        row["peak_rss_growth_gib"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0) / GIB, 3)
    close()
    del model, step, out, close
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def isolated_train_check(timeout: float, config: str, overrides: list[str], **kwargs) -> dict:
    """:func:`train_check` in a process of its own (spawned: a CUDA context of its own), so that a fault
    which breaks the CUDA context for good (the first H200 run met a misaligned address in a compiled
    kernel, and every row after it failed with it) costs its own row alone. Its exception is raised
    here (multiprocessing.TimeoutError past ``timeout`` seconds, the process ended)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(train_check, (config, overrides), kwargs).get(timeout=max(1.0, timeout))


def _stepper(model, cfg, engine: str, device: torch.device):
    """(one training step on a [B, T+1] batch, returning the model's output; what ends the engine): the
    trainer's own engine (megatok.train.engine.Engine: DeepSpeed, the config's ZeRO stage and bf16, the
    trainer's schedule), or the same step in plain torch (megatok.perf.plain_step)."""
    if engine == "deepspeed":
        if not torch.distributed.is_initialized():
            dist.init(cfg.train.collective_timeout_s)
        runner = Engine(model, deepspeed_config(cfg, 1), cfg.train, lr_lambda(cfg))

        def step(x):
            out = runner.forward(x)
            runner.backward(out.loss)
            return out

        return step, runner.ds.destroy
    opt = adamw(model, cfg.train, device)
    model.train()
    return (lambda x: plain_step(model, opt, x, grad_clip=cfg.train.grad_clip, bf16=uses_bf16(cfg))), lambda: None


def _training_row(cfg, config: str, engine: str, n_params: int, times: list[float], rate: float,
                  losses: list[float], peak: float | None) -> dict:
    """The figures of the timed steps: speed, model FLOPs and MFU at the realised rate, and for DeepSpeed
    megatok.sizing's memory estimate."""
    mb, T, bf16 = cfg.train.micro_batch_size, cfg.data.seq_len, uses_bf16(cfg)
    step_s = sorted(times)[len(times) // 2]  # median
    fpb = flops.flops_per_byte(cfg, rate=rate)["training"]
    bytes_per_s = mb * T / step_s
    achieved = fpb * bytes_per_s
    row = {"config": config, "engine": engine, "params": n_params, "micro_batch": mb, "seq_len": T,
           "precision": "bf16" if bf16 else "fp32", "zero_stage": zero_stage(cfg) if engine == "deepspeed" else None,
           "activation_checkpointing": cfg.model.activation_checkpointing, "compile": cfg.train.compile,
           "steps_timed": len(times), "step_s_median": round(step_s, 4), "bytes_per_s": round(bytes_per_s),
           "realised_rate": round(rate, 4), "train_flops_per_byte": fpb, "achieved_tflops": round(achieved / 1e12, 2),
           "mfu": round(achieved / (peak * 1e12), 4) if peak else None, "peak_tflops": peak,
           "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}
    if engine == "deepspeed":
        est = sizing.model_state_bytes(n_params, stage=zero_stage(cfg), world=1, bf16=bf16, **sizing.zero_kwargs(cfg))
        act = sizing.activation_bytes(cfg, rate=rate)["total"]
        row["estimate_gib"] = round((est["device"] + act) / GIB, 2)
    return row


def show_training(report: dict) -> list[str]:
    lines = ["training (one micro-batch per step, median step time)",
             "| config | engine | params | micro x seq | step s | bytes/s | rate | TFLOP/s | MFU | peak mem GiB | "
             "estimate GiB | loss first -> last |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["training"]:
        if "error" in r:
            lines.append(f"| {r['config']} | {r.get('engine', '-')} | error: {r['error']} |")
            continue
        mem = r.get("peak_memory_gib", r.get("peak_rss_growth_gib"))
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['config']} | {r['engine']} ({r['precision']}) | {r['params'] / 1e6:.1f}M | "
                     f"{r['micro_batch']} x {r['seq_len']} | {r['step_s_median']} | {r['bytes_per_s']:,} | "
                     f"{r['realised_rate']} | {r['achieved_tflops']} | {mfu} | {mem} | {r.get('estimate_gib', '-')} | "
                     f"{r['loss_first']} -> {r['loss_last']} |")
    return lines
