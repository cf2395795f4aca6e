"""Where a training step's time goes, by part (``megatok-bench --profile SHAPE/VARIANT``).

torch.profiler records a few plain training steps (forward, backward, clipping, AdamW: what
megatok.perf.plain_step does); each operator's own time (its self time: CPU time on a CPU, device time
on a GPU) is given to the part of the model that ran it:

- **forward**: forward hooks on the byte U-net's top-level modules open a profiler range per module
  (``megatok::<module>``); the strategy's loss is wrapped in one too; what runs in the model's own forward
  outside them (the chunk gathers, the returns, the losses) is "heads and losses";
- **backward**: an autograd node carries the sequence number of the forward operator it differentiates, so
  its time goes to that operator's part;
- **attention**: the attention kernels (scaled dot-product, FlexAttention, flash-attn), forward and
  backward, of any stack, counted apart from their stack;
- **optimizer**: gradient clipping, the AdamW step and zeroing the gradients;
- **host and idle**: the step's wall time less every operator's time (Python, launches, waiting).

The table (share of the step per part, ms per step) is printed and, with ``--json-out``, written as JSON;
the Chrome trace goes next to it (``.trace.json``) for Perfetto.
"""

from __future__ import annotations

import contextlib
import time

import torch

#: The byte U-net's top-level modules, by part (the BPE token model's ``embed``, ``main``, ``main_norm`` and
#: ``head`` fall in the same places).
PARTS = {"embed": "byte layers", "encoder": "byte layers", "decoder": "byte layers", "boundary": "policy",
         "down_proj": "main network", "main": "main network", "main_norm": "main network", "up_proj": "main network",
         "out_norm": "heads and losses", "head": "heads and losses", "early_norm": "heads and losses",
         "early_head": "heads and losses"}
ORDER = ("byte layers", "main network", "attention", "policy", "heads and losses", "optimizer", "communication",
         "host and idle")
ATTENTION = ("scaled_dot_product", "scaleddotproduct", "flash_attn", "flashattention", "flex_attention", "flexattention",
             "efficient_attention", "efficientattention")
PREFIX = "megatok::"


@contextlib.contextmanager
def labelled(model: torch.nn.Module):
    """Profiler ranges around each top-level module's forward and around the strategy's loss."""
    handles, open_ranges = [], {}
    for name, module in model.named_children():
        if name not in PARTS:
            continue

        def enter(mod, inputs, name=name):
            r = torch.autograd.profiler.record_function(PREFIX + name)
            open_ranges[name] = r
            r.__enter__()

        def leave(mod, inputs, out, name=name):
            open_ranges.pop(name).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    boundary = getattr(model, "boundary", None)
    plain_loss = boundary.loss if boundary is not None else None
    if boundary is not None:
        def loss(*args, **kwargs):
            with torch.autograd.profiler.record_function(PREFIX + "boundary"):
                return plain_loss(*args, **kwargs)
        boundary.loss = loss
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if boundary is not None:
            del boundary.loss


def _own_time(event, device: bool) -> float:
    """An event's self time in microseconds (device time on a GPU)."""
    if device:
        return float(getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0))
    return float(event.self_cpu_time_total)


def _classify(names: list[str]) -> str | None:
    """The part an operator belongs to from its own name and its enclosing ranges' (innermost first), or None
    where they say nothing (a backward operator: its forward's part decides)."""
    low = [n.lower() for n in names]
    if any(k in n for n in low for k in ATTENTION):
        return "attention"
    if any(n.startswith(PREFIX + "optimizer") for n in names):
        return "optimizer"
    if any(n.startswith(("nccl", "gloo", "c10d")) or "all_reduce" in n or "allreduce" in n for n in low):
        return "communication"
    label = next((n[len(PREFIX):] for n in names if n.startswith(PREFIX)), None)
    return None if label is None else PARTS.get(label, "heads and losses")


def attribute(events, device: bool) -> dict[str, float]:
    """{part: microseconds} over profiler ``events`` (FunctionEvents), by the rules of this module."""
    def chain(e):
        out = []
        while e is not None:
            out.append(e)
            e = e.cpu_parent
        return out

    chains = [(e, chain(e)) for e in events]
    part_of_seq: dict[int, str] = {}
    for e, c in chains:  # forward operators in a labelled range: the part of their sequence number
        part = _classify([a.name for a in c])
        if part is not None and getattr(e, "sequence_nr", -1) >= 0:
            part_of_seq.setdefault(e.sequence_nr, part)
    out = dict.fromkeys(ORDER, 0.0)
    for e, c in chains:
        t = _own_time(e, device)
        if not t or e.name.startswith(PREFIX):
            continue
        part = _classify([a.name for a in c])
        if part is None:
            seq = next((a.sequence_nr for a in c if getattr(a, "sequence_nr", -1) >= 0), None)
            part = part_of_seq.get(seq, "heads and losses")
        out[part] += t
    return out


def profile_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, batches, *, grad_clip: float, bf16: bool,
                  device: torch.device, trace: str | None = None) -> dict:
    """Profile one training step per batch of ``batches`` ([B, T+1] each): {"steps", "wall_ms_per_step",
    "parts": {part: {"ms_per_step", "share"}}}; the Chrome trace written to ``trace`` when given."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    wall = 0.0
    with labelled(model), profile(activities=activities) as prof:
        for tokens in batches:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = model(tokens[:, :-1], tokens[:, 1:])
            out.loss.backward()
            with torch.autograd.profiler.record_function(PREFIX + "optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall += time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    n = len(batches)
    parts = attribute(prof.events(), device.type == "cuda")
    wall_us = wall * 1e6
    parts["host and idle"] = max(0.0, wall_us - sum(parts.values()))
    return {"steps": n, "wall_ms_per_step": wall_us / n / 1e3,
            "parts": {k: {"ms_per_step": v / n / 1e3, "share": v / wall_us if wall_us else float("nan")}
                      for k, v in parts.items()}}


def table(result: dict, title: str) -> str:
    lines = [f"{title}: {result['wall_ms_per_step']:.1f} ms a step ({result['steps']} steps profiled)",
             f"{'part':<18} {'ms/step':>9} {'share':>7}"]
    for part, v in result["parts"].items():
        lines.append(f"{part:<18} {v['ms_per_step']:>9.2f} {100 * v['share']:>6.1f}%")
    return "\n".join(lines)
