"""Document masking through FlexAttention (megatok.model.blocks): its block mask gives the dense mask's
attention (checked here on the CPU, forward only: FlexAttention has no CPU backward), a CPU uses the
dense mask, and a device where FlexAttention fails its check falls back to the dense mask."""

import pytest
import torch

from megatok.model import blocks
from megatok.model.blocks import attention, document_attention_mask, document_block_mask, document_mask

LAYOUTS = [
    [[0] * 200, [0] * 200],  # one document per row: plain causal attention
    [[0] * 37 + [1] * 100 + [2] * 63, [0] * 128 + [1] * 72],  # boundaries inside and on a 128-block
    [[0] * 5 + [1] * 1 + [2] * 194, [3] * 199 + [4]],  # one-position documents
]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_block_mask_attends_as_the_dense_mask(layout, monkeypatch):
    monkeypatch.setattr(blocks, "_compiled_flex", blocks.flex_attention)  # eager: no compile in a test
    segments = torch.tensor(layout)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 200, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        block = document_block_mask(segments)
        assert isinstance(block, blocks.BlockMask)
        got = attention(q, k, v, mask=block)
        want = attention(q, k, v, mask=document_mask(segments)[:, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if len(set(layout[0])) == 1:
        torch.testing.assert_close(got[:1], attention(q[:1], k[:1], v[:1], backend="sdpa"), rtol=1e-5, atol=1e-5)


def test_a_cpu_uses_the_dense_mask():
    segments = torch.tensor([[0] * 4 + [1] * 6])
    assert not blocks.flex_usable(segments.device)
    mask = document_attention_mask(segments, torch.bfloat16)
    assert isinstance(mask, torch.Tensor) and mask.shape == (1, 1, 10, 10) and mask.dtype == torch.bfloat16
    assert torch.equal(mask, document_mask(segments, torch.bfloat16)[:, None])


def test_a_failed_check_falls_back_to_the_dense_mask_with_one_warning(monkeypatch):
    """A "cuda" device whose check fails (here flex_attention raises; on a machine without CUDA no tensor
    can even be made there): the answer is the dense mask, said once, and remembered."""

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(blocks, "_flex", broken)
    monkeypatch.setattr(blocks, "_FLEX_OK", {})
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match="FlexAttention failed its check on cuda"):
        assert not blocks.flex_usable(cuda)
    assert blocks._FLEX_OK == {cuda: False}
    monkeypatch.setattr(blocks, "FLEX_ATTENTION", False)
    assert not blocks.flex_usable(cuda)
