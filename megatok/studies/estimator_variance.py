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

import json
import math
import sys
from pathlib import Path

import torch

from megatok.eval.policy_probe import fixed_batch
from megatok.studies import StudyError

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
                    # the estimator as it runs once the policy learns (not held by start_step or the latch)
                    strat.options = variants[name].model_copy(update={"start_step": 0, "start_margin": None})
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


def study(run: str, variants: dict[str, dict], *, checkpoint: str | None = None, samples: int = 32,
          batch_size: int = 8, seq_len: int | None = None, data: str | None = None, seed: int = 0,
          out: str | None = None) -> dict:
    """The estimate for each variant ({name: option updates}, the run's own options with these replaced) on
    one fixed batch of the run's checkpoint: written to OUT.json and OUT.png (default RUN/estimator_variance)
    and returned. StudyError (one line) for a run whose strategy has no score-function estimator or a
    variant it cannot take; FileNotFoundError for a run or checkpoint that is not there."""
    from megatok.run.reader import load_model

    model, cfg, tag = load_model(run, checkpoint)
    if cfg.boundary.strategy != "policy":
        raise StudyError(f"{run}: strategy {cfg.boundary.strategy!r} has no score-function estimator "
                         f"(needs boundary.strategy = \"policy\")")
    try:
        variants = {name: model.boundary.variant(update) for name, update in variants.items()}
    except ValueError as e:
        raise StudyError(f"--variant: {e}") from None
    tokens = fixed_batch(cfg, data, batch_size, seq_len or cfg.data.seq_len)
    result = {"run": str(run), "checkpoint": tag, "samples": samples, "batch": list(tokens[:, 1:].shape),
              **model.boundary.estimator_settings(),
              "variants": estimate(model, tokens, variants, samples, seed)}
    out = Path(out) if out else Path(run) / "estimator_variance"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", file=sys.stderr)
    return result
