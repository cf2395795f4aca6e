"""The score-function estimator's variance, per discount gamma or per estimator variant: is the policy
gradient usable, and what does each variance-reduction option do to it?

    megatok-estimator-variance --run runs/strat-policy [--gammas 0.9,0.95,0.99,1.0] [--samples 32]
    megatok-estimator-variance --run runs/x --variant published= --variant pairs=samples:2 \
        --variant loo=leave_one_out:true --variant g0.9=gamma:0.9 [--samples 32]

For a policy checkpoint (boundary.strategy = "policy") and one fixed batch of held-out sequences,
draws ``--samples`` boundary samples (sampling seeds seed, seed+1, ...). For every sample it runs the
model once (rewards CE_early - CE_full come from that forward pass, as in training) and, for every
variant, takes the gradient of the policy loss L_policy = -lambda_policy mean_t G_t log pi(b_t) with
respect to the parameters it reaches: the policy head (``boundary``), the byte encoder (``encoder``)
and the byte embedding (``embed``). A variant is the run's own estimator options with some replaced
(``--variant NAME=KEY:VALUE,...``, any boundary.* option of the policy; ``--gammas`` is shorthand for one
variant per gamma). Variants with the same ``samples`` share the forward pass of each draw, so their
comparison is paired; a variant with ``samples: K`` runs each sequence K times per draw (``forwards``).

Per variant and parameter group (and ``all``), over the S draws g_1..g_S of the flattened gradient:

- ``mean_norm``: ||mean_s g_s||;
- ``variance``: tr Cov(g), the summed per-parameter variance (unbiased, S - 1), and
  ``variance_per_param`` = tr Cov(g) / parameters;
- ``snr``: signal-to-noise ratio of one draw, sqrt(max(0, ||mean g||^2 - tr Cov / S)) / sqrt(tr Cov)
  (the squared mean norm corrected for its own sampling noise; 0 when no signal is measurable,
  about 1 means one draw's noise is as large as the gradient itself); ``snr_per_forward`` divides it by
  sqrt(forwards), the figure to compare at equal compute.

Writes RUN/estimator_variance.json and .png (or ``--out PREFIX``) and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from megatok.eval.policy_probe import fixed_batch

GROUPS = ("boundary", "encoder", "embed")


class Moments:
    """Running sums of g and g^2 (float64) over samples, per flattened parameter group."""

    def __init__(self):
        self.n, self.s1, self.s2 = 0, {}, {}

    def add(self, grads: dict[str, torch.Tensor]) -> None:
        self.n += 1
        for k, g in grads.items():
            g = g.double()
            self.s1[k] = self.s1.get(k, 0) + g
            self.s2[k] = self.s2.get(k, 0) + g * g

    def report(self, k: str) -> dict:
        n = self.n
        mean = self.s1[k] / n
        var = (self.s2[k] - n * mean * mean).clamp(min=0) / max(1, n - 1)
        trace, mean_sq = float(var.sum()), float((mean * mean).sum())
        signal = math.sqrt(max(0.0, mean_sq - trace / n))
        return {"parameters": mean.numel(), "mean_norm": math.sqrt(mean_sq), "variance": trace,
                "variance_per_param": trace / mean.numel(),
                "snr": signal / math.sqrt(trace) if trace > 0 else float("nan")}


def estimate(model, tokens: torch.Tensor, variants: dict, samples: int, seed: int) -> dict:
    """``variants``: {name: the policy's Options} (its ``variant`` of the trained options)."""
    from megatok.vocab import PAD

    strat = model.boundary
    base_options, base_samples = strat.options, strat.samples
    groups = {g: [(n, p) for n, p in model.named_parameters() if n.split(".")[0] == g] for g in GROUPS}
    params = [p for g in GROUPS for _, p in groups[g]]
    moments = {name: Moments() for name in variants}
    x, y = tokens[:, :-1], tokens[:, 1:]
    forwards = {name: strat.samples_per_sequence(options) for name, options in variants.items()}
    by_samples: dict[int, list[str]] = {}
    for name, k in forwards.items():
        by_samples.setdefault(k, []).append(name)
    model.train()  # sample boundaries as in training
    try:
        for s in range(samples):
            for k, names in by_samples.items():
                strat.samples = k
                torch.manual_seed(seed + s)
                out = model(x, y)
                tmask = y.repeat_interleave(k, 0) != PAD
                for name in names:
                    strat.options = variants[name]
                    loss = strat.loss(out.boundaries, out.ce_full, out.ce_early, tmask)["policy_loss"]
                    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                    flat, i = {}, 0
                    for g in GROUPS:
                        parts = []
                        for _, p in groups[g]:
                            gr = grads[i]
                            parts.append((gr if gr is not None else torch.zeros_like(p)).reshape(-1))
                            i += 1
                        flat[g] = torch.cat(parts)
                    flat["all"] = torch.cat([flat[g] for g in GROUPS])
                    moments[name].add(flat)
            print(f"sample {s + 1}/{samples}", file=sys.stderr, flush=True)
    finally:
        strat.options, strat.samples = base_options, base_samples
        model.eval()
    result = {}
    for name, k in forwards.items():
        result[name] = {g: {**moments[name].report(g), "forwards": k} for g in (*GROUPS, "all")}
        for r in result[name].values():
            r["snr_per_forward"] = r["snr"] / math.sqrt(k)
    return result


def parse_variant(text: str) -> tuple[str, dict]:
    """NAME=KEY:VALUE,KEY:VALUE -> (NAME, {KEY: VALUE}) with JSON values (true, 2, 0.9); NAME= is the run's own."""
    name, _, rest = text.partition("=")
    if not name:
        raise ValueError(f"--variant {text!r}: expected NAME=KEY:VALUE,...")
    update = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY:VALUE")
        try:
            update[key] = json.loads(value)
        except json.JSONDecodeError:
            update[key] = value
    return name, update


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gammas = list(result["variants"])
    groups = [*GROUPS, "all"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(gammas)
    for j, gamma in enumerate(gammas):
        xs = [i + (j - (len(gammas) - 1) / 2) * width for i in range(len(groups))]
        var = [result["variants"][gamma][g]["variance_per_param"] for g in groups]
        snr = [result["variants"][gamma][g]["snr_per_forward"] for g in groups]
        axes[0].bar(xs, var, width, label=gamma)
        axes[1].bar(xs, snr, width, label=gamma)
    for ax, title in zip(axes, ("gradient variance per parameter (log)", "signal-to-noise ratio per forward pass")):
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend()
    fig.suptitle(f"policy-gradient estimator: {result['run']} ({result['checkpoint']}), "
                 f"{result['samples']} samples on one batch of {result['batch'][0]}x{result['batch'][1]} bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="run directory of a policy run")
    ap.add_argument("--checkpoint", default=None, help="checkpoint tag (default: latest)")
    ap.add_argument("--gammas", default="0.9,0.95,0.99,1.0", help="one variant per gamma (without --variant)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE,...",
                    help="an estimator variant: the run's policy options with these replaced (repeatable)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the run's data.seq_len")
    ap.add_argument("--data", default=None, help="shard directory (val split) or text files; default: the run's data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output prefix (default RUN/estimator_variance)")
    args = ap.parse_args(argv)
    if args.samples < 2:
        ap.error("--samples must be at least 2")
    try:
        gammas = [float(g) for g in args.gammas.split(",") if g]
    except ValueError:
        ap.error(f"--gammas {args.gammas}: expected numbers like 0.99,1.0")
    if not gammas or not all(0 <= g <= 1 for g in gammas):
        ap.error("--gammas: values in [0, 1]")
    try:
        variants = dict(map(parse_variant, args.variant)) or {f"{g:g}": {"gamma": g} for g in gammas}
    except ValueError as e:
        ap.error(str(e))

    try:
        from megatok.run.reader import load_model

        model, cfg, tag = load_model(args.run, args.checkpoint)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.boundary.strategy != "policy":
        print(f"error: {args.run}: strategy {cfg.boundary.strategy!r} has no score-function estimator "
              f"(needs boundary.strategy = \"policy\")", file=sys.stderr)
        return 2
    try:
        variants = {name: model.boundary.variant(update) for name, update in variants.items()}
    except ValueError as e:
        print(f"error: --variant: {e}", file=sys.stderr)
        return 2
    seq_len = args.seq_len or cfg.data.seq_len
    tokens = fixed_batch(cfg, args.data, args.batch_size, seq_len)
    result = {"run": str(args.run), "checkpoint": tag, "samples": args.samples, "batch": list(tokens[:, 1:].shape),
              **model.boundary.estimator_settings(),
              "variants": estimate(model, tokens, variants, args.samples, args.seed)}
    out = Path(args.out) if args.out else Path(args.run) / "estimator_variance"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
