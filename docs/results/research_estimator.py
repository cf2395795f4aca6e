"""megatok's policy gradient against the research code's own training step, on the same inputs.

    python docs/results/research_estimator.py --research PATH   (PATH: a checkout of the paper's public research
                                                                 code, whose clean_code/ holds its training step)

The research code's training step (``off_policy_flexible_training_step`` with ``early_exit_advantage_estimate``
and on-policy gating) and its discounted-return helpers are read from PATH/clean_code/*.py by name and run
on a stand-in model that returns fixed tensors: per-byte cross-entropies of a full and an early-exit model
(given as log-probabilities), sampled gates with the first gate forced as the research model forces it
(logit 100), and the gate logits as a leaf tensor. Its gradient with respect to the gate logits is then
compared with megatok's (megatok.boundaries.policy on the same cross-entropies, decisions and logits, the
rate term off): position by position, after scaling megatok's by the ratio of the two means' denominators.
Prints the largest differences; nothing of the research code is kept.
"""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.signal import lfilter

from megatok.boundaries import build_strategy

NAMES = {"bitter_llm.py": ["compute_discounted_rewards", "discounted_rewards_torch"],
         "flexible_bitter_llm.py": ["select_next_token_logits", "off_policy_flexible_training_step"]}


def research_functions(root: Path) -> dict:
    """The named top-level functions of the research code, compiled from its source alone (its modules import
    model libraries this machine need not have)."""
    env = {"torch": torch, "F": F, "np": np, "lfilter": lfilter}
    for file, names in NAMES.items():
        tree = ast.parse((root / "clean_code" / file).read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        if len(defs) != len(names):
            raise SystemExit(f"error: {root / 'clean_code' / file}: expected functions {', '.join(names)}")
        exec(compile(ast.Module(body=defs, type_ignores=[]), str(root / "clean_code" / file), "exec"), env)
    return env


class StandIn(torch.nn.Module):
    """What the research step reads from its model's output, fixed."""

    def __init__(self, out: dict):
        super().__init__()
        self.out = out
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, batch, prescribed_down_gate_samples=None):
        return self.out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--research", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512, help="tokens per row, N (the research gates all N)")
    ap.add_argument("--gamma", type=float, default=0.99)
    args = ap.parse_args(argv)
    fn = research_functions(args.research)
    B, N, V = args.batch, args.length, 260
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (B, N), generator=g)
    logits_full = torch.randn(B, N, V, generator=g, dtype=torch.float64).log_softmax(-1)
    logits_early = (1.3 * torch.randn(B, N, V, generator=g, dtype=torch.float64)).log_softmax(-1)
    gate_logits = torch.randn(B, N, generator=g, dtype=torch.float64) - 1.0
    gate_logits[:, 0] = 100.0  # the research model's forced first gate
    probs = torch.sigmoid(gate_logits)
    samples = (torch.rand(B, N, generator=g, dtype=torch.float64) < probs).long()
    samples[:, 0] = 1
    leaf = gate_logits.clone().requires_grad_(True)
    out = {"logits": logits_full, "early_logits": logits_early, "down_gate_samples": samples,
           "down_gate_probs": probs, "down_gate_logits": leaf}
    model = StandIn(out)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    fn["off_policy_flexible_training_step"](model, tokens, opt, learn_gating=True, use_off_policy=False,
                                            discount_rate=args.gamma, early_exit_advantage_estimate=True,
                                            consistency_loss_weight=0.0, relative_gating_loss_weight=1.0)
    theirs = leaf.grad[:, :N - 1]  # position N - 1 predicts nothing (its reward is the padded zero)

    # megatok: x = tokens[:, :-1] (T = N - 1 positions, each predicting the next token)
    T = N - 1
    targets = tokens[:, 1:]
    ce_full = -logits_full[:, :T].gather(-1, targets[..., None])[..., 0]
    ce_early = -logits_early[:, :T].gather(-1, targets[..., None])[..., 0]
    strat = build_strategy("policy", d_model=4, target_rate=0.2,
                           options={"lambda_policy": 1.0, "lambda_rate": 0.0, "gamma": args.gamma}).train()
    ours_logits = gate_logits[:, :T].clone().float().requires_grad_(True)
    p = torch.sigmoid(ours_logits)
    starts = samples[:, :T].bool()
    from megatok.boundaries.base import Boundaries, forced_starts

    mask = torch.ones(B, T, dtype=torch.bool)
    b = Boundaries(starts=starts, log_probs=torch.where(starts, F.logsigmoid(ours_logits), F.logsigmoid(-ours_logits)),
                   probs=p, extra={"logits": ours_logits, "sbw": torch.zeros_like(mask)})
    b.forced, b.resets = forced_starts(tokens[:, :T], mask, None), None
    strat.loss(b, ce_full.float(), ce_early.float(), mask)["policy_loss"].backward()
    ours = ours_logits.grad.double()
    decisions = B * (T - 1)
    scale = decisions / (B * N)  # megatok averages over its decisions, the research over all B x N gates
    diff = (ours[:, 1:] * scale - theirs[:, 1:]).abs()
    rel = diff.max() / theirs[:, 1:].abs().max()
    print(f"{B} rows x {N} tokens, gamma {args.gamma}: the research step's gradient on the gate logits against "
          f"megatok's x {decisions} / ({B} x {N}) = {scale:.6f}")
    print(f"  largest difference {float(diff.max()):.3e} (largest gradient {float(theirs[:, 1:].abs().max()):.3e}, "
          f"relative {float(rel):.2e}); at the forced first gate: research {float(theirs[:, 0].abs().max()):.1e}, "
          f"megatok {float(ours[:, 0].abs().max()):.1e}")
    return 0 if math.isfinite(float(rel)) and rel < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
