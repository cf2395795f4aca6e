"""model.byte_window: the byte-rate layers attend to their last W positions only (sliding-window
attention). The mask against attention computed query by query over its W keys; a byte-rate stack's
reach (L layers see L (W - 1) bytes back, no further); the byte model stays causal, its cached
generation equals a full pass, and its FLOPs count the keys a query sees."""

import pytest
import torch

from megatok import flops
from megatok.config import ConfigError, load_config
from megatok.generate import generate
from megatok.model.blocks import Stack, attention, window_attention_mask
from tests.model.test_causality import make_model
from tests.model.test_generate import PROMPT, SEQ


def test_the_mask_is_attention_over_each_querys_last_w_keys():
    torch.manual_seed(0)
    B, H, T, D, W = 2, 2, 23, 8, 5
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    got = attention(q, k, v, mask=window_attention_mask(torch.zeros(B, T, 1), W))
    for t in range(T):
        lo = max(0, t - W + 1)
        w = torch.softmax(q[:, :, t:t + 1] @ k[:, :, lo:t + 1].transpose(-1, -2) / D ** 0.5, -1)
        torch.testing.assert_close(got[:, :, t:t + 1], w @ v[:, :, lo:t + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_a_stack_reaches_exactly_layers_times_w_minus_1_bytes_back(layers):
    torch.manual_seed(0)
    W, T = 4, 20
    stack = Stack(layers, 16, 2, 32, eps=1e-5, theta=10000.0, window=W).eval()
    x = torch.randn(1, T, 16)
    x2 = x.clone()
    x2[:, 3] += 1.0
    with torch.no_grad():
        a, b = stack(x, torch.arange(T)), stack(x2, torch.arange(T))
    moved = (a - b).abs().amax(-1)[0] > 1e-6
    reach = layers * (W - 1)
    assert moved[3:3 + reach + 1].all() and not moved[:3].any() and not moved[3 + reach + 1:].any()


@pytest.mark.parametrize("strategy", ["policy", "hnet", "whitespace"])
def test_the_windowed_byte_model_is_causal(strategy):
    model = make_model(strategy, byte_window=3)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (3, 40))
    with torch.no_grad():
        base = model(x)
        for t in (4, 21):
            x2 = x.clone()
            x2[:, t + 1:] = (x2[:, t + 1:] + 1) % 256
            out = model(x2, starts=base.boundaries.starts)
            torch.testing.assert_close(out.logits[:, :t + 1], base.logits[:, :t + 1], rtol=0, atol=1e-5)
            assert not torch.allclose(out.logits[:, t + 1:], base.logits[:, t + 1:])
        # and the window is in force: the byte path alone (the early-exit head, one encoder layer) forgets
        # a byte W positions later
        x3 = x.clone()
        x3[:, 5] = (x3[:, 5] + 1) % 256
        early = model(x3).early_logits
    assert torch.equal(early[:, 8:], base.early_logits[:, 8:]) and not torch.allclose(early[:, 5], base.early_logits[:, 5])


@pytest.mark.parametrize("strategy", ["policy", "fixed"])
@pytest.mark.parametrize("document_mask", [False, True])
def test_the_cache_keeps_the_window(strategy, document_mask):
    model = make_model(strategy, heads_std=1.0, byte_window=5, document_mask=str(document_mask).lower())
    run = lambda cache: generate(model, PROMPT, seq_len=SEQ, max_bytes=SEQ - len(PROMPT) - 1, seed=7,  # noqa: E731
                                 stop_at_separator=False, cache=cache)
    cached, plain = run(True), run(False)
    assert cached.text == plain.text and cached.starts == plain.starts
    torch.testing.assert_close(torch.tensor(cached.logprobs), torch.tensor(plain.logprobs), rtol=0, atol=1e-4)


def test_flops_count_the_keys_a_windowed_query_sees():
    sets = ["model.d_model=32", "model.n_heads=2", "data.seq_len=50"]
    full = flops.flops_per_byte(load_config(None, sets, world_size=1))
    windowed = flops.flops_per_byte(load_config(None, [*sets, "model.byte_window=8"], world_size=1))
    n_byte = 2  # one encoder and one decoder layer
    assert full["byte_attention"] == n_byte * 2 * 32 * 51
    # keys per query: 1, 2, ..., 8, then 8 for the other 42 positions
    assert windowed["byte_attention"] == pytest.approx(n_byte * 4 * 32 * (36 + 42 * 8) / 50)
    assert flops.flops_per_byte(load_config(None, [*sets, "model.byte_window=50"], world_size=1)) == full
    assert windowed["main_matmul"] == full["main_matmul"]


def test_a_token_model_has_no_byte_window():
    with pytest.raises(ConfigError, match="model.byte_window"):
        load_config(None, ["model.kind=bpe", "model.byte_window=8", "model.tokenizer=x", "model.vocab_size=64",
                           "model.bytes_per_token=4", "model.n_encoder_layers=0", "model.n_decoder_layers=0"],
                    world_size=1)
