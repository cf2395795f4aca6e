"""Transformer blocks: pre-norm RMSNorm, rotary attention, SwiGLU.

All attention goes through :func:`attention`: flash-attn when it is installed, the tensors are on a
GPU and in half precision; otherwise torch's scaled_dot_product_attention (whose CUDA flash
backend is FlashAttention-2). With document masking (a ``segments`` tensor: the document each
position belongs to) attention is causal within a document only. The mask is built once per stack
and shared by its layers (:func:`document_attention_mask`): on a GPU a FlexAttention block mask
(block-sparse: no [B, T, T] tensor, and the blocks wholly outside a document are skipped) for
torch's compiled flex_attention kernel; on a CPU, where FlexAttention has no backward, or where it
fails its one-time check on the device, an explicit additive mask in the activations' dtype (a
boolean one would be converted, and kept for the backward, in every layer) for SDPA's math backend.
"""

from __future__ import annotations

import inspect
import math
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

try:  # optional GPU extra (requirements-gpu.txt)
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention
except ImportError:  # pragma: no cover - torch before 2.5
    BlockMask = create_block_mask = create_mask = flex_attention = None

#: Document masking through FlexAttention on a GPU (False: the dense mask everywhere, e.g. to compare).
FLEX_ATTENTION = True
_FLEX_OK: dict = {}  # device -> whether flex_attention passed its check there
#: How many variants (shapes, dtypes, grad modes, masks) each of megatok's compiled functions may
#: compile: the model's flex_attention, and the blocks' forward (compile_blocks). torch's default is 8
#: per function (torch._dynamo.config.recompile_limit), which one train -> eval cycle nearly fills, and
#: past it torch runs the function uncompiled: for flex_attention that materialises every score
#: ([B, H, T, T] in fp32).
RECOMPILE_LIMIT = 32
#: The compiler behind them ("eager": dynamo's tracing and caching without code generation).
COMPILE_BACKEND = "inductor"
#: "model" or "check" -> flex_attention compiled in a region of its own; "mask" -> create_block_mask (its own)
_compiled_flex: dict = {}
_flex_regions: dict = {}  # the same keys -> the function compiled there, whose code holds its variants
_flex_fallback_warned = False


#: Inductor's settings for every compiled call of megatok's (the blocks, the whole training forward,
#: FlexAttention's regions, generation's step). By default Triton kernels are compiled assuming the pointers
#: and sizes that were multiples of 16 at compile time stay so; with torch 2.11 on an H200 the decoder's
#: fused RMSNorm then failed with "CUDA error: misaligned address" in the first steps of configs/100m.json
#: and 1b.json (train.compile on), and with the assumption off both trained (1b: 36% MFU, against 30%
#: uncompiled). docs/results/2026-12-gpu.md. (FlexAttention's and generation's compiled calls with it: not
#: yet run on a GPU.)
BLOCK_INDUCTOR_OPTIONS = {"triton.divisible_by_16": False}


def compile_limited(fn, inductor_options: dict | None = None, **kwargs):
    """torch.compile of ``fn`` with COMPILE_BACKEND (with BLOCK_INDUCTOR_OPTIONS and ``inductor_options`` when
    that is inductor) and up to RECOMPILE_LIMIT variants. Where torch.compile takes no per-function limit
    (torch 2.11, the GPU image's), dynamo's process-wide recompile_limit is raised to it instead."""
    if COMPILE_BACKEND == "inductor":
        kwargs["options"] = {**BLOCK_INDUCTOR_OPTIONS, **(inductor_options or {})}
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        kwargs["recompile_limit"] = RECOMPILE_LIMIT
    else:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, backend=COMPILE_BACKEND, **kwargs)


def _region(use: str, fn):
    """``fn`` called through a function whose code object is ``use``'s alone: dynamo keeps a compiled
    function's variants, and counts them against the limit, per code object, so each use has its own
    (the check's fp32 variant costs the model's stacks none)."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    code = call.__code__.replace(co_name=f"{fn.__name__}_{use}")
    _flex_regions[use] = types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)
    return _flex_regions[use]


def _flex(q, k, v, block_mask, use: str = "model"):
    """flex_attention compiled for ``use`` (the model's stacks, or the one-time check), each in a recompile
    region of its own (:func:`_region`). Past RECOMPILE_LIMIT variants the call is SDPA with the block
    mask made dense ([B, 1, T, T] booleans: SDPA's memory-efficient kernel, no score matrix), said once.
    Inside a compiled block (train.compile) flex_attention is compiled as part of the block."""
    global _flex_fallback_warned
    if torch.compiler.is_compiling():  # traced into a compiled block (train.compile): compiled with it
        return flex_attention(q, k, v, block_mask=block_mask)
    fn = _compiled_flex.get(use)
    if fn is None:
        fn = _compiled_flex[use] = compile_limited(_region(use, flex_attention), fullgraph=True)
    try:
        return fn(q, k, v, block_mask=block_mask)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        if not _flex_fallback_warned:
            _flex_fallback_warned = True
            warnings.warn(f"megatok: FlexAttention compiled {RECOMPILE_LIMIT} variants "
                          f"(megatok.model.blocks.RECOMPILE_LIMIT); new ones use SDPA with a dense "
                          f"[B, 1, T, T] mask", stacklevel=2)
        return dense_flex(q, k, v, block_mask)


def dense_flex(q, k, v, block_mask):
    """What flex_attention computes for ``block_mask``, through SDPA with its mask made dense."""
    B, _, T, _ = q.shape
    mask = create_mask(block_mask.mask_mod, B, None, T, k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def flex_compiled_variants(use: str = "model") -> int:
    """How many variants the compiled flex_attention of ``use`` holds (of RECOMPILE_LIMIT)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    region = _flex_regions.get(use)
    return 0 if region is None else len(_debug_get_cache_entry_list(region.__code__))


def flex_check_difference(device: torch.device, flex=None) -> float:
    """The largest difference between ``flex`` (default: the compiled flex_attention, in a recompile
    region of its own) and SDPA with the dense mask, in the outputs and the gradients of q, k and v, on
    a small fp32 case on ``device``. Gradients are on, in fp32, whatever the caller runs under
    (no_grad, inference_mode, autocast): the first caller may be an evaluation."""
    flex = flex or (lambda q, k, v, block_mask: _flex(q, k, v, block_mask, "check"))
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(2, 2, 256, 64, device=device, generator=g, requires_grad=True) for _ in range(3))
        segments = torch.tensor([[0] * 100 + [1] * 156, [0] * 256], device=device)
        dout = torch.randn(2, 2, 256, 64, device=device, generator=g)
        outs = [flex(q, k, v, document_block_mask(segments, compile=device.type == "cuda")),
                F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(segments)[:, None])]
        (got, *got_grads), (want, *want_grads) = ([o, *torch.autograd.grad(o, (q, k, v), dout)] for o in outs)
        return max(float((a - b).detach().abs().max()) for a, b in zip([got, *got_grads], [want, *want_grads]))


def attention_backend(q: torch.Tensor) -> str:
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    return "sdpa"


def document_mask(segments: torch.Tensor, dtype: torch.dtype = torch.float32, window: int | None = None) -> torch.Tensor:
    """[B, T] non-decreasing document ids -> additive [B, T, T] mask of ``dtype``: 0 where position i
    may attend to j (j <= i, same document, and with a ``window`` i - j < window), -inf elsewhere.
    Every row holds its diagonal, so no row is empty."""
    T = segments.shape[1]
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal_window(T, window, segments.device)
    return torch.zeros(allowed.shape, dtype=dtype, device=segments.device).masked_fill_(~allowed, float("-inf"))


def causal_window(T: int, window: int | None, device) -> torch.Tensor:
    """bool [T, T]: True where query i may see key j: j <= i, and i - j < ``window`` when one is given."""
    i = torch.arange(T, device=device)
    lag = i[:, None] - i[None, :]
    return (lag >= 0) if window is None else (lag >= 0) & (lag < window)


def document_block_mask(segments: torch.Tensor | None, compile: bool = False, window: int | None = None,
                        shape: tuple[int, int] | None = None, device=None):
    """[B, T] document ids (None: one document per row of a ``shape`` (B, T) on ``device``) -> FlexAttention BlockMask:
    position i attends to j <= i in its document (and with a ``window``, i - j < window)."""

    def allowed(b, h, q_idx, kv_idx):
        ok = kv_idx <= q_idx
        if segments is not None:
            ok = ok & (segments[b, q_idx] == segments[b, kv_idx])
        if window is not None:
            ok = ok & (q_idx - kv_idx < window)
        return ok

    B, T = segments.shape if segments is not None else shape
    device = segments.device if segments is not None else device
    make = create_block_mask
    if compile:  # (create_block_mask's own _compile flag is deprecated for this)
        make = _compiled_flex.get("mask")
        if make is None:
            make = _compiled_flex["mask"] = compile_limited(_region("mask", create_block_mask))
    return make(allowed, B, None, T, T, device=device)


def flex_usable(device: torch.device) -> bool:
    """Whether document masking uses FlexAttention on ``device``: on a GPU (FlexAttention has no backward
    on a CPU), once it has matched the dense mask there, forward and backward, on a small case. A failure
    (no Triton, an unsupported GPU) is reported once and the dense mask is used instead."""
    if not FLEX_ATTENTION or flex_attention is None or device.type != "cuda":
        return False
    if device not in _FLEX_OK:
        try:
            diff = flex_check_difference(device)
            if not diff < 1e-2:
                raise RuntimeError(f"largest difference from the dense mask {diff:.2e}")
            _FLEX_OK[device] = True
        except Exception as e:  # noqa: BLE001 - any failure means: use the dense mask
            warnings.warn(f"megatok: FlexAttention failed its check on {device} ({type(e).__name__}: "
                          f"{str(e)[:200]}); document masking uses a dense [B, T, T] mask", stacklevel=2)
            _FLEX_OK[device] = False
    return _FLEX_OK[device]


def document_attention_mask(segments: torch.Tensor, dtype: torch.dtype, window: int | None = None):
    """The mask a stack's layers share for documents ``segments`` [B, T] (and a sliding ``window``): a
    FlexAttention BlockMask where :func:`flex_usable`, else the dense additive [B, 1, T, T] mask of ``dtype``."""
    if flex_usable(segments.device):
        return document_block_mask(segments, compile=True, window=window)
    return document_mask(segments, dtype, window)[:, None]


def window_attention_mask(x: torch.Tensor, window: int):
    """The mask a stack's layers share for a sliding ``window`` over one document per row of ``x``
    [B, T, D]: a FlexAttention BlockMask where :func:`flex_usable`, else a dense additive [T, T] mask in
    x's dtype (shared by the rows: no [B, T, T] tensor)."""
    B, T = x.shape[:2]
    if flex_usable(x.device):
        return document_block_mask(None, compile=True, window=window, shape=(B, T), device=x.device)
    allowed = causal_window(T, window, x.device)
    return torch.zeros(T, T, dtype=x.dtype, device=x.device).masked_fill_(~allowed, float("-inf"))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None = None,
              mask=None, causal: bool = True) -> torch.Tensor:
    """Causal attention over [B, H, T, Dh] tensors; ``mask`` (from :func:`document_attention_mask`, a
    BlockMask or a dense additive mask) replaces the plain causal mask. ``causal=False``: every query
    sees every key (one new query against a cache of earlier keys)."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex(q, k, v, mask)
    if mask is not None:  # (autocast may compute q in another dtype than the mask's)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
    if (backend or attention_backend(q)) == "flash_attn":
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return out.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


_INV_FREQ: dict = {}


def inverse_frequencies(head_dim: int, theta: float, device) -> torch.Tensor:
    """Rotary embeddings' theta^(-2i / head_dim), i < head_dim / 2, in fp32."""
    return theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for integer positions [T] or [B, T] -> broadcastable to [B, H, T, head_dim // 2]."""
    key = (head_dim, theta, positions.device)
    if torch.compiler.is_compiling():  # traced: computed in the graph (a cache filled while tracing recompiles)
        inv = inverse_frequencies(*key)
    else:
        if key not in _INV_FREQ:  # the same few tables at every call (generation makes one per byte and stack)
            _INV_FREQ[key] = inverse_frequencies(*key)
        inv = _INV_FREQ[key]
    angles = positions.float()[..., None] * inv
    if angles.dim() == 3:  # [B, T, D/2] -> [B, 1, T, D/2]
        angles = angles[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, window: int | None = None):
        super().__init__()
        self.n_heads, self.window = n_heads, window
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin, mask=None, kv=None, packed: "Packed | None" = None):
        """``kv``: a generation cache's hook for this layer (megatok.model.cache): ``kv(k, v, mask)`` stores
        the keys and values and returns what to attend over (k, v, mask, causal): the prompt's own, or one
        new position's query against the cached ones. ``packed``: x holds only the real positions of a
        [B, T] batch (see :class:`Packed`); attention runs on the whole [B, T] layout."""
        qkv = self.qkv(x)
        if packed is not None:
            qkv = packed.unpack(qkv)
        B, T, D = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        qkv = qkv.view(B, T, 3, self.n_heads, D // self.n_heads)
        # q and k rotated together, in the projection's layout (one pass over contiguous rows, not two
        # over strided [B, H, T, Dh] views): ``cos``/``sin`` come from Stack in [(B,) T, 1, 1, Dh/2]
        q, k = apply_rotary(qkv[:, :, :2], cos, sin).transpose(1, 3).unbind(2)
        v = qkv[:, :, 2].transpose(1, 2)
        causal = True
        if kv is not None:
            k, v, mask, causal = kv(k, v, mask)
        y = attention(q, k, v, mask=mask, causal=causal).transpose(1, 2).reshape(B, T, D)
        return self.out(y if packed is None else packed.pack(y))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, hidden: int, eps: float, window: int | None = None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d, eps=eps)
        self.attn = Attention(d, n_heads, window)
        self.mlp_norm = nn.RMSNorm(d, eps=eps)
        self.mlp = SwiGLU(d, hidden)

    def forward(self, x, cos, sin, mask=None, kv=None, packed=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, kv, packed)
        return x + self.mlp(self.mlp_norm(x))


class Packed:
    """The real positions of a [B, T] batch, ``rows`` (flat indices into B * T). A Stack given one keeps
    its residual stream as those rows only, [N, D]: the projections, MLPs and norms (which act on each
    position alone) skip the rest, and attention alone sees the whole [B, T] layout, zeros elsewhere. The
    main network uses it to skip the pad chunks that fill each row up to the batch's chunk count: they
    come after every real chunk of their row, so causal attention never lets a real chunk see one."""

    def __init__(self, rows: torch.Tensor, B: int, T: int):
        self.rows, self.B, self.T = rows, B, T

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [N, D]."""
        return x.reshape(self.B * self.T, x.shape[-1]).index_select(0, self.rows)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [B, T, D], zeros at the positions not in ``rows``."""
        return x.new_zeros(self.B * self.T, x.shape[-1]).index_copy(0, self.rows, x).view(self.B, self.T, -1)


def compile_blocks(model: nn.Module) -> int:
    """torch.compile the forward of every Block of ``model`` in place (its parameters and state-dict
    keys unchanged), with dynamic shapes: the main network's length is the number of chunks, which
    changes from batch to batch. The block's own hooks run outside the compiled code (a hook inside it
    splits the graph; see megatok.train.engine.compile_model for ZeRO-3). The blocks share their
    variants (training and evaluation, byte and chunk rate, generation's cache), up to RECOMPILE_LIMIT.
    Returns how many blocks."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.forward = compile_limited(block.forward, BLOCK_INDUCTOR_OPTIONS, dynamic=True)
    return len(blocks)


def compile_training_forward(model: nn.Module):
    """torch.compile ``model``'s forward as one graph (fullgraph: a graph break is an error) with static shapes,
    for its training calls only (train mode, no generation cache): evaluation and generation stay eager. For
    the byte U-net with model.pack_chunks, whose training forward reads nothing back to the host and has no
    shape that depends on the boundaries (train.compile 'model'). Its parameters and state-dict keys are
    unchanged. Returns the compiled function."""
    eager = model.forward
    # fallback_random: the boundary draws from torch's own generator, as in eager code (inductor's default
    # generates its own numbers: other samples, so other chunks, than an eager run or a resume would draw)
    compiled = compile_limited(eager, {**BLOCK_INDUCTOR_OPTIONS, "fallback_random": True}, fullgraph=True,
                               dynamic=False)

    def forward(*args, **kwargs):
        if model.training and kwargs.get("cache") is None:
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    model.forward = forward
    return compiled


def init_matrices(model: nn.Module, std: float, n_layers: int, skip: str | None = None) -> None:
    """GPT-2 initialisation: N(0, std) on every matrix, N(0, std / sqrt(2 n_layers)) on the
    projections that write into the residual stream (attn.out, mlp.down); vectors keep their
    defaults. Parameters whose name starts with ``skip`` are left alone.

    It runs through ``Module.apply``, one module's own parameters at a time; apply visits children
    before their parent, which is the order of named_parameters() as long as only leaf modules hold
    parameters (true of every megatok model), so the draws are those of a loop over
    named_parameters(). DeepSpeed's ZeRO-3 construction (zero.Init) partitions each module as soon as
    it is built and gathers a module's parameters around an ``apply`` call, so the same code
    initialises a model that no rank ever holds whole, with the same random draws.
    """
    names = {m: n for n, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        prefix = names[module]
        for pname, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            if skip and name.startswith(skip):
                continue
            if name.endswith(("attn.out.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * n_layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=std)

    model.apply(init)


def ffn_hidden(d: int, mult: float, multiple_of: int) -> int:
    return multiple_of * math.ceil(d * mult / multiple_of)


class Stack(nn.Module):
    """A sequence of blocks sharing one rotary table; optional activation checkpointing per block.
    ``window``: every layer attends to the last ``window`` positions only (sliding-window attention;
    None: every earlier position)."""

    def __init__(self, n_layers: int, d: int, n_heads: int, hidden: int, *, eps: float, theta: float,
                 checkpointing: bool = False, window: int | None = None):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, n_heads, hidden, eps, window) for _ in range(n_layers))
        self.head_dim, self.theta, self.checkpointing, self.window = d // n_heads, theta, checkpointing, window

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None = None,
                cache=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``segments`` [B, T]: the document of each position (document masking), or None (causal).
        ``cache``: for generation, one hook per layer (megatok.model.cache.KVCache; see Attention). ``rows``: the positions that
        carry data (flat indices into B * T; the others must come after them in their row), None: all;
        the layers run on those only (:class:`Packed`) and the others' outputs are zeros."""
        # [T, Dh/2] or [B, 1, T, Dh/2] -> [(B,) T, 1, 1, Dh/2]: the layout of Attention's [B, T, 2, H, Dh] q and k
        cos, sin = (t[..., None, None, :] if t.dim() == 2 else t[:, 0, :, None, None, :]
                    for t in rotary_tables(positions, self.head_dim, self.theta))
        window = self.window if self.window is not None and self.window < x.shape[1] else None
        if segments is not None:
            mask = document_attention_mask(segments, x.dtype, window)
        elif window is not None:  # (one new position on a filled cache: the cache keeps the window)
            mask = window_attention_mask(x, window)
        else:
            mask = None
        packed = None if rows is None else Packed(rows, x.shape[0], x.shape[1])
        if packed is not None:
            x = packed.pack(x)
        for i, layer in enumerate(self.layers):
            if self.checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, None, packed, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, None if cache is None else cache[i], packed)
        return x if packed is None else packed.unpack(x)
