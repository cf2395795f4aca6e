"""A checkpoint's full weights, one tensor at a time: the ZeRO merge without a copy of the whole model.

``checkpoint_tensors`` returns {name: LazyTensor} for a checkpoint of any ZeRO stage and world size;
each LazyTensor knows its shape and gives its fp32 value (``load()``) only when asked. The checkpoint's
files are memory-mapped (``torch.load(mmap=True)``), so what is read from disk is only what is loaded,
and an Adam moment is never read at all. A reader that converts and stores each tensor before asking for
the next (megatok.run.reader.load_model, megatok.run.export) holds one copy of the weights in its own
dtype plus one tensor in fp32; the memory-mapped pages it read stay in the page cache, which the kernel
takes back under pressure.

- ZeRO-3: DeepSpeed's lazy conversion (``get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)``),
  which gathers a parameter from every rank's flat fp32 partition when it is asked for.
- ZeRO-1/2: the same per parameter, here: DeepSpeed's own lazy mode first concatenates every rank's
  partition into one flat fp32 vector of the whole model. A parameter's elements are a contiguous range
  of that (virtual) concatenation, cut from the ranks' partitions it spans.
- ZeRO-0: the weights in ``mp_rank_00_model_states.pt``.

The values are exactly those of DeepSpeed's ``zero_to_fp32`` (tests/api/test_export.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass
class LazyTensor:
    """A checkpoint tensor not read yet: ``load()`` gives it (a new contiguous CPU tensor)."""

    shape: torch.Size
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _ready(t: torch.Tensor) -> LazyTensor:
    return LazyTensor(t.shape, t.dtype, lambda: t.clone())


def _quiet():
    """DeepSpeed prints progress on stdout; the tools keep stdout for their own output."""
    return contextlib.redirect_stdout(sys.stderr)


def zero_stage_of(ckpt: Path) -> int:
    """The ZeRO stage a checkpoint was written with, from its files (0: no optimizer partitions)."""
    if not list(ckpt.glob("*_optim_states.pt")):
        return 0
    return 3 if list(ckpt.glob("zero_pp_rank_*_model_states.pt")) else 2


def checkpoint_tensors(ckpt: str | Path) -> dict[str, LazyTensor]:
    """{name: LazyTensor} of a DeepSpeed checkpoint directory (``RUN/checkpoints/<tag>``), fp32 for the
    trained weights (the optimizer's master copy under ZeRO 1-3), buffers in their own dtype."""
    ckpt = Path(ckpt)
    stage = zero_stage_of(ckpt)
    if stage == 0:
        state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True, weights_only=True)
        module = state["module"]
        return {k: LazyTensor(v.shape, torch.float32 if v.is_floating_point() else v.dtype,
                              (lambda v=v: v.float().clone() if v.is_floating_point() else v.clone()))
                for k, v in module.items()}
    if stage == 3:
        return _zero3(ckpt)
    return _zero2(ckpt)


def _zero3(ckpt: Path) -> dict[str, LazyTensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with _quiet():
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name, lazy_mode=True)
    out = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor):  # buffers and frozen parameters, already whole
            out[name] = _ready(t)
        else:  # a GatheredTensor: gathered from every rank's partition by contiguous()
            out[name] = LazyTensor(torch.Size(t.shape), t.dtype, t.contiguous)
    return out


def _zero2(ckpt: Path) -> dict[str, LazyTensor]:
    """ZeRO-1/2: rank r's optimizer file holds, per parameter group g, a flat fp32 partition; the
    partitions of g in rank order are the group's parameters flattened one after another (each followed
    by its alignment padding, if the checkpoint records one), padded at the end."""
    from deepspeed.checkpoint.constants import (BUFFER_NAMES, FROZEN_PARAM_FRAGMENTS, FROZEN_PARAM_SHAPES,
                                                PARAM_SHAPES)
    from deepspeed.utils.zero_to_fp32 import get_optim_files, parse_optim_states

    # the model states file holds the whole module in the training dtype: memory-mapped, only its buffers read
    model_state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True, weights_only=False)
    with _quiet():
        stage, world, flat_groups, paddings = parse_optim_states(get_optim_files(str(ckpt)), str(ckpt))
    out: dict[str, LazyTensor] = {}
    buffer_names = model_state[BUFFER_NAMES]
    for k, v in model_state["module"].items():
        if k in buffer_names:
            out[k] = _ready(v.float() if v.is_floating_point() else v)
    for name in (model_state.get(FROZEN_PARAM_SHAPES) or {}):
        out[name] = _ready(model_state[FROZEN_PARAM_FRAGMENTS][name])
    for g, shapes in enumerate(model_state[PARAM_SHAPES]):
        parts = [flat_groups[r][g] for r in range(world)]
        sizes = [p.numel() for p in parts]
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = math.prod(shape)
            out[name] = LazyTensor(torch.Size(shape), torch.float32,
                                   (lambda p=parts, z=sizes, o=offset, n=n, s=shape: _cut(p, z, o, n).view(s)))
            offset += n + (paddings[g][i] if paddings is not None else 0)
        align = 2 * world  # DeepSpeed pads each group to a multiple of 2 x world size
        if math.ceil(offset / align) * align != math.ceil(sum(sizes) / align) * align:
            raise ValueError(f"{ckpt}: parameter group {g} holds {sum(sizes)} elements but its parameters "
                             f"take {offset}: not a checkpoint of this layout")
    for alias, source in model_state.get("shared_params", {}).items():
        if source in out:
            out[alias] = out[source]
    return out


def _cut(parts: list[torch.Tensor], sizes: list[int], offset: int, n: int) -> torch.Tensor:
    """Elements [offset, offset + n) of the concatenation of ``parts``, read from the parts they lie in."""
    pieces, start = [], 0
    for part, size in zip(parts, sizes):
        lo, hi = max(offset, start), min(offset + n, start + size)
        if lo < hi:
            pieces.append(part[lo - start:hi - start])
        start += size
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
