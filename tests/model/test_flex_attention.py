"""Document masking through FlexAttention (megatok.model.blocks): its block mask gives the dense mask's
attention (checked here on the CPU, forward only: FlexAttention has no CPU backward), a CPU uses the
dense mask, and a device where FlexAttention fails its check falls back to the dense mask. The check
computes gradients whatever mode its first caller runs in, and the compiled flex_attention keeps its
variants in a region of its own, with a stated limit past which it uses SDPA, never uncompiled flex; the
compiled block mask is the eager one."""

import warnings

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
    monkeypatch.setattr(blocks, "_compiled_flex", {"model": blocks.flex_attention})  # eager: no compile in a test
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


def _causal_only(q, k, v, block_mask):
    """A kernel that ignores the documents: what the check must catch."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast"])
def test_the_check_computes_gradients_whatever_mode_its_first_caller_runs_in(mode):
    """An evaluation, generation or API process meets the check first under no_grad (inference_mode,
    autocast): the check still compares outputs and gradients, in fp32, and tells a right kernel from a
    wrong one. On the CPU (FlexAttention has no backward there) the kernel under test is dense_flex,
    what flex_attention computes for the block mask, through SDPA."""
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[mode]
    cpu = torch.device("cpu")
    with context():
        assert blocks.flex_check_difference(cpu, flex=blocks.dense_flex) < 1e-5
        assert blocks.flex_check_difference(cpu, flex=_causal_only) > 1e-2
        assert torch.is_grad_enabled() == (mode == "autocast")  # the caller's mode is back


def _qkv(T: int, D: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(T + D)
    return [torch.randn(2, 2, T, D, generator=g).to(dtype) for _ in range(3)]


def test_the_compiled_flex_keeps_its_variants_apart_from_the_check_and_past_its_limit_uses_sdpa(monkeypatch):
    """The check's fp32 compile is in a region of its own, so it costs the model's stacks none of their
    RECOMPILE_LIMIT variants; past the limit a new variant is SDPA on the dense block mask (the
    same attention; no [B, H, T, T] score matrix as uncompiled flex_attention makes), said once. Dynamo's
    tracing and caching are real here; only its compiler is "eager" (inductor would take minutes on a CPU)."""
    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(blocks, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)  # the limit where torch has no per-function one
    monkeypatch.setattr(blocks, "_compiled_flex", {})
    monkeypatch.setattr(blocks, "_flex_fallback_warned", False)
    segments = torch.tensor([[0] * 40 + [1] * 88, [0] * 128])
    mask = document_block_mask(segments)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback and no uncompiled flex_attention while in the limit
        blocks._flex(*_qkv(128, 16), mask, "check")
        for D in (16, 32):  # two variants: the head sizes of a byte stack and the main network
            blocks._flex(*_qkv(128, D), mask)
            blocks._flex(*_qkv(128, D), mask)  # a variant seen before compiles nothing
        assert blocks.flex_compiled_variants() == 2 and blocks.flex_compiled_variants("check") == 1
        q, k, v = _qkv(128, 16, torch.bfloat16)  # a third variant: past the limit
        warnings.simplefilter("default")
        with pytest.warns(UserWarning, match="FlexAttention compiled 2 variants"):
            got = blocks._flex(q, k, v, mask)
        want = attention(q, k, v, mask=document_mask(segments, torch.bfloat16)[:, None])
        torch.testing.assert_close(got, want)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            blocks._flex(*_qkv(128, 8), mask)  # said once
        assert not [w for w in seen if "FlexAttention compiled" in str(w.message)]
    assert blocks.flex_compiled_variants() == 2


def test_a_first_call_from_inside_a_compiled_block_leaves_the_eager_path_compiled(monkeypatch):
    """With train.compile the first masked attention runs inside a compiled block: flex_attention is
    compiled with the block there, and a later call outside one (a block past its limit, another caller)
    still finds flex_attention compiled, not a function that runs it uncompiled."""
    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(blocks, "_compiled_flex", {})
    segments = torch.tensor([[0] * 40 + [1] * 88, [0] * 128])
    mask = document_block_mask(segments)

    def block(q, k, v):
        return blocks._flex(q * 2, k, v, mask)

    compiled = torch.compile(block, backend="eager")
    q, k, v = _qkv(128, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # "flex_attention called without torch.compile()" would raise
        torch.testing.assert_close(compiled(q, k, v), block(q, k, v))
    assert blocks.flex_compiled_variants() == 1


def test_the_compiled_blocks_keep_every_variant_of_a_train_eval_generate_cycle(monkeypatch):
    """train.compile's blocks share one compiled forward: training and evaluation (grad modes, batch
    sizes), byte and chunk rate, document masks and generation's cache each add variants, and a tiny
    model's cycle fills torch's default limit of 8 (past which the blocks would run uncompiled); the
    next variant still compiles, up to RECOMPILE_LIMIT."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from megatok.config import load_config
    from megatok.data.stream import pack_documents
    from megatok.generate import generate
    from megatok.model import build_model
    from tests.conftest import stdlib_texts

    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    cfg = load_config("configs/tiny.json", ["data.seq_len=128", "model.document_mask=true"], world_size=1)
    torch.manual_seed(0)
    model = build_model(cfg)
    blocks.compile_blocks(model)
    x = pack_documents([t.encode() for t in stdlib_texts(8)], 128)[:6]
    for i in range(2):
        model(x[2 * i:2 * i + 2, :-1], x[2 * i:2 * i + 2, 1:]).loss.backward()
    model.eval()
    with torch.no_grad():
        for batch in (2, 4):
            model(x[:batch, :-1], x[:batch, 1:])
    for prompt in (b"def main(", b"import os\n"):
        generate(model, prompt, seq_len=128, max_bytes=24, seed=0, stop_at_separator=False)
    def variants():
        return len(_debug_get_cache_entry_list(blocks.Block.forward))

    cycle = variants()
    assert cycle >= 8  # torch's default limit, filled
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # one more: bf16 evaluation
        model(x[:2, :-1], x[:2, 1:])
    assert cycle < variants() <= blocks.RECOMPILE_LIMIT  # compiled, not run as it is
    torch._dynamo.reset()


def test_compile_limited_raises_the_process_wide_limit_where_torch_compile_takes_no_per_function_one(monkeypatch):
    """torch 2.11 (the GPU image's) has no ``recompile_limit`` argument to torch.compile: passing one was a
    TypeError that stopped every compiled run there; the process-wide limit is raised instead."""
    seen = {}

    def old_compile(fn, *, fullgraph=False, dynamic=None, backend="inductor", options=None):  # 2.11's arguments
        seen.update(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
        return fn

    monkeypatch.setattr(torch, "compile", old_compile)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    assert blocks.compile_limited(len, dynamic=True) is len
    assert seen == {"fullgraph": False, "dynamic": True, "backend": blocks.COMPILE_BACKEND}
    assert torch._dynamo.config.recompile_limit == blocks.RECOMPILE_LIMIT


def test_the_blocks_compile_without_inductors_divisible_by_16_specialisation(monkeypatch):
    """The blocks' dynamic-shape code is compiled without Triton's divisible-by-16 specialisation (a
    misaligned address on an H200 with it, docs/results/2026-12-gpu.md), and so is every other compiled call
    (the flex_attention regions among them); other backends get no inductor options."""
    from megatok.config import load_config
    from megatok.model import build_model

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    model = build_model(load_config("configs/tiny.json", world_size=1))
    for backend, options in (("inductor", {"triton.divisible_by_16": False}), ("eager", None)):
        calls.clear()
        monkeypatch.setattr(blocks, "COMPILE_BACKEND", backend)
        assert blocks.compile_blocks(model) == len(calls) > 0
        assert all(kw.get("options") == options and kw["dynamic"] is True for kw in calls)
    calls.clear()
    blocks.compile_limited(blocks.flex_attention, fullgraph=True)
    assert "options" not in calls[0]  # the eager backend, last set above
    monkeypatch.setattr(blocks, "COMPILE_BACKEND", "inductor")
    blocks.compile_limited(blocks.flex_attention, fullgraph=True)
    assert calls[1]["options"] == {"triton.divisible_by_16": False}


def test_generations_compiled_step_keeps_as_many_variants_as_the_blocks(monkeypatch):
    """megatok.generate.compiled_step compiles one variant per model and batch size: through compile_limited,
    up to RECOMPILE_LIMIT of them (torch's default of 8 would send the ninth to eager code, unsaid)."""
    from megatok import generate
    from megatok.config import load_config
    from megatok.model import build_model

    calls = []

    def compile(fn, recompile_limit=8, **kw):  # a torch.compile that takes the limit (2.13)
        calls.append({**kw, "recompile_limit": recompile_limit})
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setattr(generate, "_COMPILED", {})
    generate.compiled_step(build_model(load_config("configs/tiny.json", world_size=1)))
    assert calls == [{"dynamic": False, "recompile_limit": blocks.RECOMPILE_LIMIT, "backend": blocks.COMPILE_BACKEND,
                      "options": blocks.BLOCK_INDUCTOR_OPTIONS}]


def test_the_compiled_block_mask_equals_the_eager_one_without_the_deprecated_flag(monkeypatch):
    """What a GPU builds (compile=True: create_block_mask compiled once, in a region of its own, not through
    its deprecated ``_compile`` flag) is the eager block mask, block for block, with and without a window."""
    monkeypatch.setattr(blocks, "_compiled_flex", {})
    segments = torch.tensor([[0] * 37 + [1] * 300 + [2] * 47, [0] * 384])  # full blocks in the second row
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*_compile flag", category=DeprecationWarning)
        for window, full in ((None, 3), (200, 0)):  # full blocks: row 2's (1, 0), (2, 0) and (2, 1)
            got = document_block_mask(segments, compile=True, window=window)
            want = document_block_mask(segments, compile=False, window=window)
            for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (window, name)
            assert int(want.full_kv_num_blocks.sum()) == full
    assert set(blocks._compiled_flex) == {"mask"}
