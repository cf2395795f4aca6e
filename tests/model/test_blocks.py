import math

import torch

from megatok.model.blocks import apply_rotary, attention, attention_backend, rotary_tables
from megatok.model.chunking import chunk_index, downsample, upsample


def naive_causal_attention(q, k, v):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_attention_matches_reference_and_uses_sdpa_on_cpu():
    q, k, v = torch.randn(3, 2, 4, 17, 8).unbind(0)
    assert attention_backend(q) == "sdpa"  # flash-attn only for CUDA half-precision tensors
    torch.testing.assert_close(attention(q, k, v), naive_causal_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_rotary_preserves_norm_and_encodes_relative_position():
    pos = torch.arange(10)
    cos, sin = rotary_tables(pos, 8, 10000.0)
    q, k = torch.randn(2, 1, 1, 8)
    qs = apply_rotary(q.expand(1, 1, 10, 8), cos, sin)[0, 0]
    ks = apply_rotary(k.expand(1, 1, 10, 8), cos, sin)[0, 0]
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(10))
    # the score depends on the offset only
    torch.testing.assert_close(qs[3] @ ks[1], qs[7] @ ks[5], rtol=1e-5, atol=1e-5)


def test_downsample_upsample_by_hand():
    starts = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    h = torch.arange(12, dtype=torch.float).view(2, 6, 1)
    chunks, pos, real = downsample(h, starts)
    assert pos[0].tolist() == [0, 3, 4]
    assert chunks[0, :, 0].tolist() == [0.0, 3.0, 4.0]
    assert real.tolist() == [[True, True, True], [True, False, False]]
    assert chunks[1, 0, 0].item() == 6.0
    assert chunk_index(starts).tolist() == [[0, 0, 0, 1, 2, 2], [0, 0, 0, 0, 0, 0]]
    z = torch.tensor([[[10.0], [20.0], [30.0]], [[40.0], [0.0], [0.0]]])
    assert upsample(z, starts)[..., 0].tolist() == [[10, 10, 10, 20, 30, 30], [40] * 6]
