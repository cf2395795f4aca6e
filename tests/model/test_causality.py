"""Nothing downstream of a chunk sees the future: perturbing byte t+1 leaves every output at <= t
unchanged, and the loss at t has zero gradient with respect to inputs after t. For every strategy
(its straight-through gate and the EMA smoothing hook included), and without holding boundaries
fixed the decisions at <= t never depend on later bytes."""

import pytest
import torch

from megatok.config import load_config
from megatok.model.unet import ByteUNet
from megatok.vocab import PAD
from tests.conftest import decisive

STRATEGIES = ["policy", "policy-window3", "policy-lag1", "fixed", "hnet", "gumbel", "uniform", "whitespace", "bpe"]


def strategy_sets(strategy: str) -> list[str]:
    """--set items for a strategy name; "name-variant" selects options."""
    if strategy == "policy-window3":
        return ["boundary.strategy=policy", "boundary.window=3"]
    if strategy == "policy-lag1":
        return ["boundary.strategy=policy", "boundary.lag=1"]
    if strategy == "bpe":
        from tests.boundaries.tokenizer import tiny_bpe_model

        return ["boundary.strategy=bpe", f"boundary.model_path={tiny_bpe_model()}"]
    return [f"boundary.strategy={strategy}"]


def make_model(strategy, heads_std=25.0, **model):
    sets = strategy_sets(strategy) + ["model.d_model=32", "model.n_heads=2", "model.n_main_layers=2",
                                      "train.micro_batch_size=2"] + [f"model.{k}={v}" for k, v in model.items()]
    cfg = load_config(None, sets, world_size=1)
    torch.manual_seed(0)
    model = ByteUNet(cfg.model, cfg.boundary).eval()
    if strategy.startswith("policy"):
        # Heads that decide (std 25: logits of std ~3, h has an RMS near init_std, 0.02), so a head that
        # read later bytes would flip draws and move p.
        decisive(model.boundary, heads_std)
    return model


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("t", [0, 5, 17, 38])
def test_perturbing_the_future_leaves_the_past_unchanged(strategy, t):
    model = make_model(strategy)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (3, 40))
    with torch.no_grad():
        base = model(x)
        starts = base.boundaries.starts
        x2 = x.clone()
        x2[:, t + 1:] = (x2[:, t + 1:] + 1 + torch.randint(0, 254, x2[:, t + 1:].shape)) % 256
        out = model(x2, starts=starts)  # boundaries held fixed
    torch.testing.assert_close(out.logits[:, :t + 1], base.logits[:, :t + 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.early_logits[:, :t + 1], base.early_logits[:, :t + 1], rtol=0, atol=1e-5)
    # and the change is real: later positions do move
    assert not torch.allclose(out.logits[:, t + 1:], base.logits[:, t + 1:])


TEXTS = [b"the self.thing = other  # words, and more text here\n    return x",
         b"def singing(s):\n    return s.strings + 'ring'  # naive caf\xc3\xa9",
         b"In the beginning there were bytes; then the tokens came along, always"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cut", [5, 21, 33])
def test_policy_boundaries_do_not_depend_on_the_future(strategy, cut):
    """Without holding them fixed: boundary decisions and probabilities at < cut use only bytes < cut
    (same sampling seed). Real text continued by other real text (random bytes rarely change a rule's decision);
    with these cuts, the non-causal bpe rule="exact" fails this test."""
    model = make_model(strategy).train()
    x = torch.randint(0, 256, (4, 64))
    for i, text in enumerate(TEXTS):
        x[i] = torch.tensor(list((text * 2)[:64]))
    x2 = x.clone()
    x2[:3, cut:] = x[[1, 2, 0], cut:]  # another text's continuation
    x2[3, cut:] = torch.randint(0, 256, (64 - cut,))
    torch.manual_seed(5)
    a = model(x)
    torch.manual_seed(5)
    b = model(x2)
    assert torch.equal(a.boundaries.starts[:, :cut], b.boundaries.starts[:, :cut])
    if a.boundaries.probs is not None:  # sharper than the draws: a head that read later bytes moves p
        torch.testing.assert_close(a.boundaries.probs[:, :cut], b.boundaries.probs[:, :cut], rtol=0, atol=1e-6)
    torch.testing.assert_close(a.logits[:, :cut], b.logits[:, :cut], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_of_loss_at_t_wrt_later_inputs_is_zero(strategy, checkpointing):
    model = make_model(strategy, activation_checkpointing=str(checkpointing).lower()).train()
    x = torch.randint(0, 256, (2, 48))
    kept = {}

    def keep(module, inputs, output):
        output.retain_grad()
        kept["emb"] = output

    model.embed.register_forward_hook(keep)
    out = model(x[:, :-1], x[:, 1:])
    t = 20
    ce = torch.nn.functional.cross_entropy(out.logits[:, t], x[:, t + 1]) + \
        torch.nn.functional.cross_entropy(out.early_logits[:, t], x[:, t + 1])
    ce.backward()
    grad = kept["emb"].grad
    assert grad[:, t + 1:].abs().max().item() == 0.0
    assert grad[:, :t + 1].abs().max().item() > 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padding_never_leaks_into_real_positions(strategy):
    """A short sequence padded in a batch with a long one gives the same outputs as on its own."""
    model = make_model(strategy)
    torch.manual_seed(3)
    long, short = torch.randint(0, 256, (1, 50)), torch.randint(0, 256, (1, 23))
    starts_long = torch.rand(1, 50) < 0.3
    starts_short = torch.rand(1, 23) < 0.3
    batch = torch.full((2, 50), PAD)
    batch[0], batch[1, :23] = long[0], short[0]
    starts = torch.zeros(2, 50, dtype=torch.bool)
    starts[0], starts[1, :23] = starts_long[0], starts_short[0]
    starts[1, 23:] = True  # the model must ignore boundaries on padding
    with torch.no_grad():
        together = model(batch, starts=starts)
        alone = model(short, starts=starts_short)
    torch.testing.assert_close(together.logits[1, :23], alone.logits[0], rtol=0, atol=1e-5)
    assert not together.boundaries.starts[1, 23:].any()
