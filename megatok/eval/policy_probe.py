"""What one boundary is worth: the counterfactual probe behind ``megatok-boundary-value``.

For a trained byte model and a fixed batch of held-out sequences: draw boundaries from the model's own
strategy (seeded), then, many times over, add ONE chunk start at a position t where the sample has
none and measure the discounted loss it saves,

    V(t) = sum_{k >= t} gamma^(k - t) (CE_base(k) - CE_added(k))      (nats; > 0: the boundary helps)

where CE(k) is the full model's loss on its prediction at k (of byte k + 1). A decision at t affects
only predictions at k >= t, so V(t) is exactly the part of the policy's return that its decision at t
changes, here measured without noise from the other decisions (they are held fixed). Positions are
grouped by byte class (a space before a word, a word's first byte, inside a word, anything else); the
report gives each class's mean V with its standard error (by sequence: draws of one sequence are not
independent; :func:`clustered_stderr`), next to the standard deviation of the estimator's own return G_t in
the same sample: the noise a decision's credit carries in training.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from megatok.boundaries.base import finalize_starts, forced_starts
from megatok.data.documents import DataError
from megatok.stats import space_before_word, word_byte_table, word_starts
from megatok.vocab import PAD, SEP

CLASSES = ("space_before_word", "word_start", "inside_word", "other")


def fixed_batch(cfg, data: str | None, batch_size: int, seq_len: int) -> torch.Tensor:
    """The first ``batch_size`` packed sequences [B, seq_len + 1] of the validation split (or of
    ``data``: a shard directory's val split or text/JSONL files). DataError (one line naming the data) for
    data that cannot be read or holds fewer than ``batch_size`` sequences, or for a run's own data that is a
    ``pipe:`` command (megatok.data.stream.from_run_config)."""
    from megatok.data.inputs import read_documents
    from megatok.data.stream import from_run_config, pack_documents

    spec = data or from_run_config(cfg.data.val_shards or cfg.data.shards,
                                   "data.val_shards" if cfg.data.val_shards else "data.shards")
    texts, have, need = [], 0, batch_size * (seq_len + 1)
    for d in read_documents(list(spec) if isinstance(spec, dict) else spec, "val"):
        texts.append(d.text)
        have += len(d.text) + 1
        if have >= need:
            break
    tokens = pack_documents(texts, seq_len)[:batch_size]
    if len(tokens) < batch_size:
        raise DataError(f"{spec}: only {len(tokens)} sequences of {seq_len} bytes, need {batch_size}")
    return tokens


def byte_classes(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """bool [B, T] per class in CLASSES; they partition the positions t >= 1 that are real."""
    real = x != PAD
    real[:, 0] = False
    sbw, ws = space_before_word(x), word_starts(x)
    word = word_byte_table().to(x.device)[x]
    out = {"space_before_word": sbw, "word_start": ws, "inside_word": word & ~ws}
    out["other"] = ~(sbw | ws | out["inside_word"])
    return {k: v & real for k, v in out.items()}


def clustered_stderr(values: torch.Tensor, groups: list[int]) -> float:
    """The standard error of the mean of ``values`` when the draws of one group (a sequence) are not
    independent: sqrt(sum over groups of (their summed deviations from the mean)^2) / n, the cluster-robust
    (sandwich) estimator; NaN with fewer than two groups. Draws of one sequence share its context, so they
    err together: counted by draw, the error of a class whose value depends on the sequence is too small."""
    n = len(values)
    if n < 2 or len(set(groups)) < 2:
        return float("nan")
    dev = values.double() - values.double().mean()
    sums = torch.zeros(max(groups) + 1, dtype=torch.float64).index_add_(0, torch.tensor(groups), dev)
    return float(sums.pow(2).sum().sqrt() / n)


def discounted_future(d: torch.Tensor, gamma: float, t: torch.Tensor) -> torch.Tensor:
    """sum_{k >= t_i} gamma^(k - t_i) d[i, k] for each row i."""
    T = d.shape[1]
    lag = torch.arange(T, device=d.device)[None, :] - t[:, None]
    w = torch.where(lag >= 0, gamma ** lag.clamp(min=0).double(), 0.0)
    return (d.double() * w).sum(1)


@torch.no_grad()
def boundary_values(model, tokens: torch.Tensor, *, gamma: float, rounds: int, seed: int) -> dict:
    """Per class: n, mean V (nats), its standard error, mean p (the strategy's probability there, where
    it has one); and the estimator's return noise (:func:`return_noise`). See the module docstring."""
    model.eval()
    x, y = tokens[:, :-1], tokens[:, 1:]
    B, T = x.shape
    real = x != PAD
    forced = forced_starts(x, real, SEP) if model.cfg.document_mask else forced_starts(x, real, None)
    gen = torch.Generator().manual_seed(seed)
    first = model(x)
    probs = first.boundaries.probs
    if probs is None:  # a strategy without probabilities: its own (deterministic) boundaries
        base_starts = first.boundaries.starts
    else:
        base_starts = finalize_starts(torch.rand(probs.shape, generator=gen) < probs.float(), real, forced)

    def ce(starts):
        logits = model(x, starts=starts).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), y.reshape(-1), ignore_index=PAD,
                                                 reduction="none").view(B, T)
        return loss * (y != PAD)

    base = ce(base_starts)
    classes = byte_classes(x)
    free = ~base_starts & ~forced
    values: dict[str, list[float]] = {c: [] for c in CLASSES}
    sequences: dict[str, list[int]] = {c: [] for c in CLASSES}  # the row of each draw
    for _ in range(rounds):
        for c in CLASSES:
            cand = classes[c] & free
            rows = cand.any(1).nonzero().flatten()
            if not len(rows):
                continue
            # one random candidate position per row that has one
            score = torch.rand(B, T, generator=gen) * cand
            t = score.argmax(1)
            added = base_starts.clone()
            added[rows, t[rows]] = True
            v = discounted_future(base - ce(added), gamma, t)
            values[c] += v[rows].tolist()
            sequences[c] += rows.tolist()
    out = {"gamma": gamma, "rounds": rounds, "batch": [B, T], "classes": {}}
    for c in CLASSES:
        v = torch.tensor(values[c], dtype=torch.float64)
        n = len(v)
        out["classes"][c] = {
            "n": n, "sequences": len(set(sequences[c])), "value": float(v.mean()) if n else float("nan"),
            "stderr": clustered_stderr(v, sequences[c]),
            "stderr_by_draw": float(v.std() / math.sqrt(n)) if n > 1 else float("nan"),
            "p": float(probs[classes[c]].float().mean()) if probs is not None and classes[c].any() else None,
            # the fraction of the class's positions where the drawn sample starts a chunk
            "started": float(base_starts[classes[c]].float().mean()) if classes[c].any() else None,
        }
    out["chunkings"] = whole_chunkings(ce, x, y < 256, real, forced, base_starts, probs, gen)
    # the main network's output removed altogether (the decoder reads the byte layers' state alone)
    hook = model.up_proj.register_forward_hook(lambda module, inputs, output: torch.zeros_like(output))
    try:
        out["main_off_bpb"] = bits_per_byte(ce(base_starts), y < 256)
    finally:
        hook.remove()
    out["return_std"] = return_noise(model, x, y, forced, gamma, seed)
    return out


def return_noise(model, x, y, forced, gamma: float, seed: int) -> float:
    """The standard deviation, over decisions, of the published estimator's discounted return G_t (reward
    CE_early - CE_full, batch baseline) on this batch, one training-mode draw of the model's own boundaries:
    the noise a decision's credit carries in training (measured for any strategy, as the return a policy
    would meet on this model)."""
    from megatok import rl

    model.train()
    samples, model.boundary.samples = model.boundary.samples, 1
    try:
        with torch.no_grad():
            torch.manual_seed(seed)
            trained = model(x, y)
    finally:
        model.boundary.samples = samples
        model.eval()
    reward = (trained.ce_early - trained.ce_full).float() * (y != PAD)
    G = rl.discounted_returns(rl.batch_baseline(reward, y != PAD), gamma, resets=trained.boundaries.resets)
    return float(G[(y != PAD) & ~forced].std())


def bits_per_byte(loss: torch.Tensor, byte_targets: torch.Tensor) -> float:
    """Mean loss (nats) over byte targets, in bits (SEP targets left out, as everywhere)."""
    return float((loss * byte_targets).sum() / byte_targets.sum() / math.log(2))


def whole_chunkings(ce, x, byte_targets, real, forced, sampled, probs, gen) -> dict:
    """bpb of the same bytes under whole alternative chunkings: the run's own sample, chunks at every
    space before a word (plus the forced starts), and uniform random starts at that same rate; for a
    strategy with probabilities also its threshold rule (p > 0.5); and the forced starts only (one chunk
    per window, or per document with document masking: every byte then gets the main network's output
    for the window's first byte). Does placement matter to this model, and does its main network carry
    any context at all (``forced_only`` against ``sampled``: see :func:`main_context`)?"""
    sbw = finalize_starts(space_before_word(x) | forced, real, forced)
    rate = float(sbw[real].float().mean())
    uniform = finalize_starts(torch.rand(x.shape, generator=gen) < rate, real, forced)
    alts = {"sampled": sampled, "space_before_word": sbw, "uniform_same_rate": uniform}
    if probs is not None:
        alts["threshold"] = finalize_starts(probs > 0.5, real, forced)
    alts["forced_only"] = forced & real
    out = {}
    for name, starts in alts.items():
        out[name] = {"bpb": bits_per_byte(ce(starts), byte_targets),
                     "rate": float(starts[real].float().mean())}
    return out


def main_context(result: dict) -> float:
    """Bits per byte the main network's context is worth to the model: its loss with one chunk per window
    (the forced starts only) minus its loss with the run's own chunks. About zero when the main network
    has learned to add the same vector whatever it reads, as on cpu-small's prose runs (docs/replication/):
    then no placement can matter to that model."""
    c = result["chunkings"]
    return c["forced_only"]["bpb"] - c["sampled"]["bpb"]


def probe_checkpoint(run_dir, tag: str | None, *, data: str | None, batch_size: int, seq_len: int | None,
                     gamma: float, rounds: int, seed: int) -> dict:
    """:func:`boundary_values` for checkpoint ``tag`` of a byte model's run (None: the latest), on the
    first ``batch_size`` held-out sequences, with the checkpoint's step and training bytes. Raises
    FileNotFoundError for a missing run or checkpoint, ValueError for a token model's run."""
    from megatok.run.checkpoints import read_meta
    from megatok.run.reader import load_model

    model, cfg, tag = load_model(run_dir, tag)
    if cfg.model.kind != "unet":
        raise ValueError(f"{run_dir}: a {cfg.model.kind} token model has no boundaries to probe")
    meta = read_meta(run_dir, tag)
    tokens = fixed_batch(cfg, data, batch_size, seq_len or cfg.data.seq_len)
    return {"run": str(run_dir), "checkpoint": tag, "strategy": cfg.boundary.strategy, "step": meta.get("step"),
            "bytes_seen": meta.get("metrics", {}).get("bytes_seen"),
            **boundary_values(model, tokens, gamma=gamma, rounds=rounds, seed=seed)}


def trend(results: list[dict], cls: str = "space_before_word") -> list[dict]:
    """One row per probed checkpoint (in training order): step, training bytes, the value of a start at
    ``cls`` with its standard error, the return noise, their ratio (the learnability map's axis), the
    fraction of ``cls`` positions the run's own sample starts a chunk at, and :func:`main_context` (None
    for a result from before it was measured)."""
    rows = []
    for r in sorted(results, key=lambda r: (r.get("step") or 0)):
        c = r["classes"][cls]
        rows.append({"checkpoint": r["checkpoint"], "step": r.get("step"), "bytes_seen": r.get("bytes_seen"),
                     "value": c["value"], "stderr": c["stderr"], "return_std": r["return_std"],
                     "ratio": c["value"] / r["return_std"] if r["return_std"] else float("nan"),
                     "started": c.get("started"),
                     "context": main_context(r) if "forced_only" in r.get("chunkings", {}) else None})
    return rows


def format_trend(rows: list[dict], cls: str = "space_before_word") -> str:
    lines = [f"the value of a chunk start at {cls} against training:",
             f"{'checkpoint':<14} {'bytes':>12} {'value (nats)':>13} {'stderr':>8} {'noise':>7} {'value/noise':>12}"
             f" {'started':>8} {'context':>8}"]
    for r in rows:
        b = "" if r["bytes_seen"] is None else f"{r['bytes_seen']:,.0f}"
        s = "" if r["started"] is None else f"{r['started']:.3f}"
        ctx = "" if r.get("context") is None else f"{r['context']:+.4f}"
        lines.append(f"{r['checkpoint']:<14} {b:>12} {r['value']:>13.4f} {r['stderr']:>8.4f} {r['return_std']:>7.3f}"
                     f" {r['ratio']:>12.4f} {s:>8} {ctx:>8}")
    return "\n".join(lines)


def plot_trend(rows: list[dict], path, title: str, cls: str = "space_before_word") -> None:
    """value / noise of a start at ``cls`` (with +- 2 standard errors), the fraction of ``cls`` positions
    that start a chunk, and (where measured) the main network's context, against training bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [(r["bytes_seen"] or 0) / 1e6 for r in rows]
    context = [r.get("context") for r in rows]
    panels = 3 if any(c is not None for c in context) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
    a, b = axes[0], axes[1]
    a.errorbar(x, [r["ratio"] for r in rows], yerr=[2 * r["stderr"] / r["return_std"] for r in rows],
               marker="o", capsize=3)
    a.axhline(0, color="grey", lw=0.8)
    a.set(xlabel="training bytes (millions)", ylabel="value / return noise", title=f"a start at {cls}")
    b.plot(x, [r["started"] for r in rows], marker="o")
    b.set(xlabel="training bytes (millions)", ylabel="fraction that start a chunk", ylim=(0, 1),
          title="the run's own boundaries there")
    if panels == 3:
        axes[2].plot(x, [float("nan") if c is None else c for c in context], marker="o")
        axes[2].axhline(0, color="grey", lw=0.8)
        axes[2].set(xlabel="training bytes (millions)", ylabel="bits per byte",
                    title="the main network's context (one chunk - own)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(result: dict) -> str:
    lines = [f"{'class':<18} {'n':>6} {'value (nats)':>13} {'stderr':>9} {'p':>7}"]
    for c, r in result["classes"].items():
        p = "" if r["p"] is None else f"{r['p']:.3f}"
        lines.append(f"{c:<18} {r['n']:>6} {r['value']:>13.4f} {r['stderr']:>9.4f} {p:>7}")
    lines.append("whole chunkings of the batch: " + ", ".join(
        f"{k} {v['bpb']:.4f} bpb (rate {v['rate']:.3f})" for k, v in result["chunkings"].items()))
    lines.append(f"the main network's context (forced_only - sampled): {main_context(result):+.4f} bits per byte"
                 + ("" if "main_off_bpb" not in result else "; its output altogether (output zeroed - sampled): "
                    f"{result['main_off_bpb'] - result['chunkings']['sampled']['bpb']:+.4f}"))
    if "return_std" in result:
        lines.append(f"estimator return noise (std of G_t over decisions, gamma {result['gamma']}): "
                     f"{result['return_std']:.3f} nats")
    return "\n".join(lines)


def probe_run(run: str, checkpoint: str | None = None, *, data: str | None = None, batch_size: int = 16,
              seq_len: int | None = None, gamma: float = 0.99, rounds: int = 8, seed: int = 0,
              out: Path | None = None, plot: Path | None = None) -> int:
    """What megatok-boundary-value does: each checkpoint of ``run`` probed (``checkpoint``: a tag, "all"
    for every kept one, a comma-separated list of tags, or None for the latest), its table printed; for
    several, the trend printed and, with ``plot``, drawn; ``out``: the result as JSON. 0, or 2 with one
    error line for a run, checkpoint or data that cannot be read."""
    from megatok.run.checkpoints import published_tags

    several = checkpoint is not None and (checkpoint == "all" or "," in checkpoint)
    tags = ([checkpoint] if not several else published_tags(run) if checkpoint == "all"
            else [t for t in checkpoint.split(",") if t])
    if not tags:
        print(f"error: {run}: no checkpoint to probe", file=sys.stderr)
        return 2
    results = []
    for tag in tags:
        try:
            result = probe_checkpoint(run, tag, data=data, batch_size=batch_size, seq_len=seq_len, gamma=gamma,
                                      rounds=rounds, seed=seed)
        except (FileNotFoundError, ValueError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{run} ({result['checkpoint']}, {result['strategy']}): one added boundary, discounted loss saved "
              f"(gamma {gamma}), {rounds} per sequence and class on {result['batch'][0]} x "
              f"{result['batch'][1]} bytes")
        print(format_table(result), flush=True)
        results.append(result)
    rows = trend(results) if several else None
    if several:
        print(format_trend(rows))
        if plot:
            plot_trend(rows, plot, f"{run} ({results[0]['strategy']})")
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"trend": rows, "checkpoints": results} if several else results[0]
        out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0
