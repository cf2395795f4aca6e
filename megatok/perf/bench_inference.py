"""megatok-bench --inference: generation speed, the byte model against the matched BPE model.

Bytes per second of megatok.generate.generate_batch (sampled boundaries and ids, no stop) at batch 1
and 8 (prompts of 8 lengths, 16 to 200 bytes, each row with its own seed; batch 1: the one of 90 bytes,
about their mean), for the byte model of each shape and the BPE token model matched to it in training
FLOPs per byte (megatok-match-bpe, on a ``--vocab`` tokenizer trained here on the same text). Both are
untrained: the byte model's boundaries are drawn at its target rate, and the BPE model's bytes per second
are its tokens per second times the tokenizer's bytes per token on the text (an untrained model's random
tokens are longer than a text's); each row generates ``--gen-bytes`` bytes of text (the BPE model: that
many bytes' worth of tokens), each step as ``--generation-step`` says (cached, static or compiled; the
warm-up round compiles). Figures: batch 8 over batch 1; the byte model over the BPE model at batch 8;
each one's model FLOP/s (megatok.flops' forward FLOPs per byte) over the matmul's; and the **per-step
overhead**, a step's time less its FLOPs at the matmul's FLOP/s.

The rounds run in turns as the training benchmark's do, with its clock, matmul peak, figure summaries
and targets (megatok.perf.timing, megatok.perf.bench).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from megatok.perf import bench as common, timing
from megatok.perf.bench import GENERATION_STEPS, SHAPES, Settings, figure
from megatok.perf.timing import environment, matmul_peak, summary, sync, text_documents

#: the batch sizes of the generation figures
GEN_BATCHES = (1, 8)


def run(settings: Settings) -> int:
    """The generation figures (see the module docstring) for megatok-bench's ``settings``: rounds of
    every (shape, kind, batch) in turns; prints the report, 0; 2 on a config that does not load."""
    prepared = common.prepare(settings)
    if prepared is None:
        return 2
    settings, device, config, _ = prepared
    from megatok import bpe

    tmp = Path(tempfile.mkdtemp(prefix="megatok-bench-"))
    docs = text_documents(300_000 if settings.quick else 2_000_000)
    tok = bpe.train_bpe(docs, tmp / "bpe", settings.vocab)
    sp = bpe.load_tokenizer(tok["model"])
    per_token = bpe.bytes_per_token(sp, docs)["bytes_per_token"]
    piece = statistics.mean(len(p) for p in bpe.token_bytes(sp) if p)  # an untrained model's mean token
    # 8 lengths; batch 1 reads the first, 90 bytes, about their mean (91)
    prompts = [d[:n] for d, n in zip(docs[::7], (90, 24, 200, 57, 130, 16, 170, 40))]
    variants = generation_variants(settings, device, config, tok, per_token, piece)
    peak = matmul_peak(device, settings.matmul or (8192 if device.type == "cuda" else 1024))
    how = GENERATION_STEPS[settings.generation_step]
    for v in variants.values():  # warm-up (and the compile of --generation-step compile)
        generation_round(v, prompts, device, how)
    print(f"bench --inference: {len(variants)} variants, {settings.reps} rounds, device {device}", file=sys.stderr, flush=True)
    rounds: list[dict] = []
    names = list(variants)
    for r in range(settings.reps):
        got = {"matmul": peak()}
        for name in names[r % len(names):] + names[:r % len(names)]:
            got[name] = generation_round(variants[name], prompts, device, how)
        rounds.append(got)
        print(f"bench --inference: round {r + 1}/{settings.reps} done", file=sys.stderr, flush=True)
    figures, measured = generation_figures(settings, variants, rounds)
    measured["matmul_flops"] = summary([g["matmul"] for g in rounds])
    measured["bpe"] = {"vocab": tok["vocab_size"], "bytes_per_token": per_token, "mean_piece_bytes": piece}
    report = {"environment": environment(device, settings.threads), "settings": {
        k: getattr(settings, k) for k in ("config", "overrides", "shapes", "reps", "gen_bytes", "vocab", "generation_step")},
        "figures": figures, "measured": measured}
    if settings.json_out:
        Path(settings.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(show_generation(report, names, tok["vocab_size"], per_token))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def generation_variants(settings: Settings, device: torch.device, config, tok: dict, per_token: float, piece: float) -> dict:
    """{shape/kind/bB: the model and what its figures need}: each shape's byte model and the BPE model
    matched to it (on the tokenizer ``tok``, ``per_token`` bytes per token on the text, pieces of ``piece``
    bytes on average), at each batch of GEN_BATCHES."""
    from megatok import flops
    from megatok.config import load_config
    from megatok.data.encoding import encoding_for
    from megatok.model import build_model

    variants: dict[str, dict] = {}
    for s in settings.shapes:
        ucfg = config(s, "policy")
        match = flops.match_bpe(ucfg, tokenizer=tok["model"], vocab_size=tok["vocab_size"], bytes_per_token=per_token)
        o = match["overrides"]
        bcfg = load_config(settings.config, [*SHAPES[s], *settings.overrides, *(f"model.{k}={v}" for k, v in o["model"].items()),
                                         f"data.seq_len={o['data']['seq_len']}"], world_size=1)
        for kind, cfg in (("byte", ucfg), ("bpe", bcfg)):
            torch.manual_seed(0)
            with torch.device(device):
                model = build_model(cfg).eval()
            enc = encoding_for(cfg)
            byte = kind == "byte"
            fpb = flops.flops_per_byte(cfg)["forward"]  # BPE: at its bytes per token
            for B in GEN_BATCHES:
                variants[f"{s}/{kind}/b{B}"] = {
                    "model": model, "cfg": cfg, "enc": enc, "B": B, "bytes_per_id": 1.0 if byte else per_token,
                    "max_bytes": settings.gen_bytes if byte else round(settings.gen_bytes * piece / per_token),
                    "flops_per_id": fpb if byte else fpb * per_token, "params": sum(p.numel() for p in model.parameters())}
    return variants


def generation_round(v: dict, prompts: list[bytes], device: torch.device, how: dict) -> dict:
    """One timed generate_batch of variant ``v``: seconds, ids, steps (the longest row's ids), chunk starts."""
    from megatok.generate import generate_batch

    sync(device)
    t0 = timing.now()
    gens = generate_batch(v["model"], [prompts[i % len(prompts)] for i in range(v["B"])], seq_len=v["cfg"].data.seq_len,
                          max_bytes=v["max_bytes"], seeds=list(range(v["B"])), boundary_mode="sample",
                          encoding=v["enc"], stop_at_separator=False, **how)
    sync(device)
    dt = timing.now() - t0
    ids, steps = sum(len(g.ids) for g in gens), max(len(g.ids) for g in gens)
    return {"s": dt, "ids": ids, "steps": steps, "chunks": sum(sum(g.starts) for g in gens)}


def generation_figures(settings: Settings, variants: dict, rounds: list[dict]) -> tuple[dict, dict]:
    """(figures, measured) of the generation rounds: batch 8 over batch 1, the byte model over the BPE
    model, and each variant's MFU, per-step overhead and speed."""
    figures, measured = {}, {}
    names = list(variants)

    def bytes_per_s(name: str) -> list[float]:
        return [g[name]["ids"] * variants[name]["bytes_per_id"] / g[name]["s"] for g in rounds]

    for s in settings.shapes:
        for kind in ("byte", "bpe"):
            b1, b8 = bytes_per_s(f"{s}/{kind}/b1"), bytes_per_s(f"{s}/{kind}/b8")
            figure(figures, f"gen_b8_vs_b1/{kind}/{s}", [x / y for x, y in zip(b8, b1)],
                   "generation bytes/s, batch 8 / batch 1")
        figure(figures, f"gen_byte_vs_bpe_b8/{s}",
               [x / y for x, y in zip(bytes_per_s(f"{s}/byte/b8"), bytes_per_s(f"{s}/bpe/b8"))],
               "generation bytes/s at batch 8, byte model / matched BPE model")
        for name in (n for n in names if n.startswith(f"{s}/")):
            v = variants[name]
            step = [g[name]["s"] / g[name]["steps"] for g in rounds]
            work = [v["B"] * v["flops_per_id"] / g["matmul"] for g in rounds]  # a step's FLOPs at the matmul's rate
            figure(figures, f"gen_mfu/{name}",
                   [g[name]["ids"] * v["flops_per_id"] / g[name]["s"] / g["matmul"] for g in rounds],
                   "model FLOP/s / matmul FLOP/s")
            figure(figures, f"gen_overhead_ms/{name}", [(t - w) * 1e3 for t, w in zip(step, work)],
                   "a step's time less its FLOPs at the matmul's FLOP/s, ms")
            measured[name] = {"bytes_per_s": summary(bytes_per_s(name)), "step_ms": summary([t * 1e3 for t in step]),
                              "flops_per_id": v["flops_per_id"], "bytes_per_id": v["bytes_per_id"],
                              "params": v["params"], "steps": rounds[-1][name]["steps"],
                              "chunks_per_byte": rounds[-1][name]["chunks"] / max(1, rounds[-1][name]["ids"])}
    return figures, measured


def show_generation(report: dict, names: list[str], vocab: int, per_token: float) -> str:
    figures, measured, env = report["figures"], report["measured"], report["environment"]
    lines = [f"megatok bench --inference, {env['date']}: {env.get('gpu') or env.get('cpu')} ({env['device']}, "
             f"{env['threads']} thread(s)), torch {env['torch']}", "",
             f"{'figure':<34} {'median':>9} {'min':>9} {'max':>9}  {'target':<8} {'met':<5} what", "-" * 110]
    for key, f in figures.items():
        met = "" if "met" not in f else ("yes" if f["met"] else "NO")
        lines.append(f"{key:<34} {f['median']:>9.4g} {f['min']:>9.4g} {f['max']:>9.4g}  {f.get('target', ''):<8} "
                     f"{met:<5} {f['what']}")
    lines += ["", f"{'variant':<18} {'bytes/s':>9} {'step ms':>8} {'params':>10} {'FLOPs/id':>10}"]
    for name in names:
        m = measured[name]
        lines.append(f"{name:<18} {m['bytes_per_s']['median']:>9,.0f} {m['step_ms']['median']:>8.3f} {m['params']:>10,} "
                     f"{m['flops_per_id']:>10.3g}")
    lines.append(f"\nmatmul {measured['matmul_flops']['median'] / 1e9:.1f} GFLOP/s; BPE vocabulary {vocab}, "
                 f"{per_token:.2f} bytes/token on the text")
    return "\n".join(lines)
