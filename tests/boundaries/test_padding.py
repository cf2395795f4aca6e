"""Padding takes no part in a strategy's training terms: changing the encoder states at padded
positions leaves the policy, rate, prior and ratio losses unchanged (the model's own padding tests
cover the forward pass; these cover each strategy's loss and its use of the mask)."""

import pytest
import torch

from megatok.boundaries import build_strategy
from tests.boundaries.test_policy_options import AT_ONCE


def at_once(name: str, options: dict) -> dict:
    """The policy with its terms on from the first step (AT_ONCE); the other strategies as given."""
    return {**AT_ONCE, **options} if name == "policy" else options


@pytest.mark.parametrize("name,options", [("policy", {}), ("policy", {"window": 3}),
                                          ("policy", {"rate_scope": "sequence"}), ("gumbel", {}), ("hnet", {})])
def test_padding_takes_no_part_in_the_strategy_losses(name, options):
    strat = build_strategy(name, d_model=8, target_rate=0.25, options=at_once(name, options)).train()
    torch.manual_seed(0)
    h = torch.randn(3, 40, 8)
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1, 25:] = False
    mask[2, 10:] = False
    ce_full, ce_early = torch.rand(3, 40) * mask, torch.rand(3, 40) * mask  # the model's losses are 0 at padding

    def losses(h):
        torch.manual_seed(1)
        b = strat(h, None, mask)
        return {k: v.item() for k, v in strat.loss(b, ce_full, ce_early, mask).items()}

    noisy = h.clone()
    noisy[~mask] = 10 * torch.randn(int((~mask).sum()), 8)
    base = losses(h)
    assert base and all(v != 0 for v in base.values())
    assert losses(noisy) == base


@pytest.mark.parametrize("name,options", [("policy", {}), ("policy", {"rate_scope": "sequence"}), ("gumbel", {}),
                                          ("hnet", {})])
def test_a_padded_sequence_has_the_rate_term_of_its_real_part(name, options):
    """The rate, prior and ratio terms count real bytes only: a sequence padded from 25 to 40 bytes
    gets the term of its 25 real bytes."""
    strat = build_strategy(name, d_model=8, target_rate=0.25, options=at_once(name, options)).train()
    torch.manual_seed(0)
    h = torch.randn(1, 40, 8)
    mask = torch.arange(40)[None] < 25

    def rate_term(h, mask):
        torch.manual_seed(1)  # the first 25 draws are the same for 25 or 40 positions
        b = strat(h, None, mask)
        ce = torch.zeros(mask.shape)
        return strat.loss(b, ce, ce, mask)["rate_loss"]

    whole = rate_term(h[:, :25], torch.ones(1, 25, dtype=torch.bool))
    assert whole != 0 and torch.allclose(rate_term(h, mask), whole, rtol=1e-6, atol=0)
