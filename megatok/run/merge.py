"""A checkpoint's full weights, one tensor at a time: the ZeRO merge without a copy of the whole model.

``checkpoint_tensors`` returns {name: LazyTensor} for a checkpoint of any ZeRO stage and world size;
each LazyTensor knows its shape and gives its value (``load(dtype)``) only when asked. The checkpoint's
files are memory-mapped (``torch.load(mmap=True)``), so what is read from disk is only what is loaded,
and an Adam moment is never read at all. A reader that converts and stores each tensor before asking for
the next (megatok.run.reader.load_model, megatok.run.export) holds one copy of the weights in its own
dtype (each tensor is converted as it is copied out of the files); the memory-mapped pages it read stay
in the page cache, which the kernel takes back under pressure.

- ZeRO-3: DeepSpeed's lazy conversion (``get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)``):
  where each parameter lies in every rank's flat fp32 partition, gathered here when it is asked for.
- ZeRO-1/2: the same per parameter, here: DeepSpeed's own lazy mode first concatenates every rank's
  partition into one flat fp32 vector of the whole model. A parameter's elements are a contiguous range
  of that (virtual) concatenation, cut from the ranks' partitions it spans.
- ZeRO-0: the weights in ``mp_rank_00_model_states.pt``.

The values are exactly those of DeepSpeed's ``zero_to_fp32`` (tests/run/test_export.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from megatok.run.safe_load import weights_only_loads


@dataclass
class LazyTensor:
    """A checkpoint tensor not read yet: ``load(dtype=None)`` gives it, a new contiguous CPU tensor, in
    ``dtype`` if given (a floating tensor): converted as it is copied out of the memory-mapped files,
    never held in fp32 first."""

    shape: torch.Size
    dtype: torch.dtype
    reader: Callable[[torch.dtype], torch.Tensor]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reader(dtype if dtype is not None and self.dtype.is_floating_point else self.dtype)


def _ready(t: torch.Tensor) -> LazyTensor:
    return LazyTensor(t.shape, t.dtype, lambda dtype: t.to(dtype, copy=True))


def _assemble(pieces: list[torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of the concatenation of 1-D ``pieces``, copied into a new tensor of
    ``dtype`` (converted on the way: no full-size temporary)."""
    out = torch.empty(numel, dtype=dtype)
    pos = 0
    for piece in pieces:
        take = min(piece.numel(), numel - pos)
        if take <= 0:
            break
        out[pos:pos + take].copy_(piece[:take])
        pos += take
    if pos != numel:
        raise ValueError(f"the checkpoint's partitions hold {pos} of a tensor's {numel} elements")
    return out


@contextlib.contextmanager
def _quiet():
    """DeepSpeed prints progress on stdout (the tools keep stdout for their own output) and draws a "Loading
    checkpoint shards" bar on every merge (a moment's work, and "shards" there are not data shards): the
    one goes to stderr, the other is not drawn."""
    from functools import partial
    from unittest import mock

    from deepspeed.utils import zero_to_fp32

    with contextlib.redirect_stdout(sys.stderr), mock.patch.object(zero_to_fp32, "tqdm",
                                                                   partial(zero_to_fp32.tqdm, disable=True)):
        yield


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
        with weights_only_loads():
            state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
        module = state["module"]
        return {k: LazyTensor(v.shape, torch.float32 if v.is_floating_point() else v.dtype,
                              (lambda dtype, v=v: v.to(dtype, copy=True)))
                for k, v in module.items()}
    if stage == 3:
        return _zero3(ckpt)
    return _zero2(ckpt)


def _zero3(ckpt: Path) -> dict[str, LazyTensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with _quiet(), weights_only_loads():
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name, lazy_mode=True)
    out = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor):  # buffers and frozen parameters, already whole
            out[name] = _ready(t)
        else:  # a GatheredTensor: its slice of every rank's flat partition, gathered when loaded
            out[name] = LazyTensor(torch.Size(t.shape), t.dtype, (lambda dtype, t=t: _gather(t, dtype)))
    return out


def _gather(t, dtype: torch.dtype) -> torch.Tensor:
    """A DeepSpeed GatheredTensor (ZeRO-3: ``partitioned_numel`` elements at ``offset`` of each rank's
    flat groups, ranks in order, padded at the end) in ``dtype``: what its contiguous() gives, without
    the fp32 concatenation."""
    bounds, end = t.flat_groups_offset, t.offset + t.partitioned_numel
    pieces = []
    for groups in t.flat_groups:
        for g in range(len(bounds) - 1):
            lo, hi = max(t.offset, bounds[g]), min(end, bounds[g + 1])
            if lo < hi:
                pieces.append(groups[g][lo - bounds[g]:hi - bounds[g]])
    return _assemble(pieces, math.prod(t.shape), dtype).view(t.shape)


def _zero2(ckpt: Path) -> dict[str, LazyTensor]:
    """ZeRO-1/2: rank r's optimizer file holds, per parameter group g, a flat fp32 partition; the
    partitions of g in rank order are the group's parameters flattened one after another (each followed
    by its alignment padding, if the checkpoint records one), padded at the end."""
    from deepspeed.checkpoint.constants import (BUFFER_NAMES, FROZEN_PARAM_FRAGMENTS, FROZEN_PARAM_SHAPES,
                                                PARAM_SHAPES)
    from deepspeed.utils.zero_to_fp32 import get_optim_files, parse_optim_states

    # the model states file holds the whole module in the training dtype: memory-mapped, only its buffers read
    with _quiet(), weights_only_loads():
        model_state = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
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
                                   (lambda dtype, p=parts, z=sizes, o=offset, n=n, s=shape: _cut(p, z, o, n, dtype).view(s)))
            offset += n + (paddings[g][i] if paddings is not None else 0)
        align = 2 * world  # DeepSpeed pads each group to a multiple of 2 x world size
        if math.ceil(offset / align) * align != math.ceil(sum(sizes) / align) * align:
            raise ValueError(f"{ckpt}: parameter group {g} holds {sum(sizes)} elements but its parameters "
                             f"take {offset}: not a checkpoint of this layout")
    for alias, source in model_state.get("shared_params", {}).items():
        if source in out:
            out[alias] = out[source]
    return out


def _cut(parts: list[torch.Tensor], sizes: list[int], offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements [offset, offset + n) of the concatenation of ``parts``, read from the parts they lie in."""
    pieces, start = [], 0
    for part, size in zip(parts, sizes):
        lo, hi = max(offset, start), min(offset + n, start + size)
        if lo < hi:
            pieces.append(part[lo - start:hi - start])
        start += size
    return _assemble(pieces, n, dtype)
