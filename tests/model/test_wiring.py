"""How the U-net wires its parts, where a mistake would leave causality intact and go unnoticed: the
early-exit head reads the encoder only (else the reward CE_early - CE_full collapses), the main
network gets the byte position of each chunk start (rotary on byte index, as documented), and a
strategy's EMA smoothing coefficient is read at each chunk's start byte."""

import pytest
import torch

from megatok.vocab import PAD
from tests.model.test_causality import make_model


@pytest.mark.parametrize("strategy", ["policy", "hnet"])
def test_early_exit_head_reads_the_encoder_only(strategy):
    model = make_model(strategy)
    x = torch.randint(0, 256, (2, 24))
    model.zero_grad()
    model(x).early_logits.square().sum().backward()
    reached = {n.split(".")[0] for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"embed", "encoder", "early_norm", "early_head"} <= reached
    assert not reached & {"main", "decoder", "head", "out_norm", "down_proj", "up_proj", "main_norm"}, reached


def test_main_network_gets_the_byte_positions_of_the_chunk_starts():
    model = make_model("fixed")  # every 5th byte (target rate 0.2)
    seen = []
    forward = model.main.forward
    model.main.forward = lambda h, positions, docs, cache, **kw: seen.append(positions) or forward(h, positions, docs,
                                                                                              cache, **kw)
    x = torch.randint(0, 256, (2, 23))
    starts = model(x).boundaries.starts
    (positions,) = seen
    for row in range(2):
        where = starts[row].nonzero().flatten()
        assert where.tolist() == [0, 5, 10, 15, 20]
        assert torch.equal(positions[row, :len(where)], where)


def test_smoothing_is_read_at_each_chunk_start():
    """hnet sets ``smooth``. P = 1 at every chunk start means no smoothing at all, whatever P is
    elsewhere; P < 1 at the starts must change the output."""
    model = make_model("hnet")
    x = torch.randint(0, 256, (2, 30))
    strategy = model.boundary.forward

    def with_smooth(at_starts):
        def forward(h, x, mask, forced):
            b = strategy(h, x, mask, forced)
            b.smooth = None if at_starts is None else torch.where(b.starts, at_starts, 0.3)
            return b
        model.boundary.forward = forward
        try:
            out = model(x)
        finally:
            model.boundary.forward = strategy
        assert out.boundaries.starts.sum() > 4  # several chunks per row: the EMA has something to mix
        return out.logits

    plain = with_smooth(None)
    assert torch.allclose(with_smooth(1.0), plain, atol=1e-6)
    assert not torch.allclose(with_smooth(0.5), plain, atol=1e-3)


def test_pinned_boundaries_are_for_inference_only():
    model = make_model("policy")
    x = torch.randint(0, 256, (1, 12))
    with pytest.raises(ValueError, match="inference only"):
        model(x, x, starts=torch.ones(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_the_lm_loss_weighs_the_full_and_early_exit_cross_entropies(weight):
    """lm_loss = (1 - w) CE_full + w CE_early over real targets (model.early_exit_weight), each CE
    computed here from the logits; the loss backward takes is the sum of the terms."""
    model = make_model("policy", early_exit_weight=weight).train()
    x = torch.randint(0, 256, (3, 21))
    x[2, 15:] = PAD
    targets = torch.cat([x[:, 1:], torch.full((3, 1), PAD)], 1)
    out = model(x, targets)
    real = targets != PAD
    full = torch.nn.functional.cross_entropy(out.logits[real], targets[real])
    early = torch.nn.functional.cross_entropy(out.early_logits[real], targets[real])
    assert early.item() != pytest.approx(full.item(), rel=1e-3)
    torch.testing.assert_close(out.terms["lm_loss"], (1 - weight) * full + weight * early)
    torch.testing.assert_close(out.loss, sum(out.terms.values()))
    assert set(out.terms) == {"lm_loss", "policy_loss", "rate_loss"}
