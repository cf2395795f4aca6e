"""The one interface every boundary strategy implements.

``forward`` sees the encoder states and the bytes and decides where chunks start.
``loss`` runs after the model has produced its per-byte losses and returns the strategy's
training terms (policy gradient, rate control, ratio loss, ...). The model never needs to
know which strategy it holds.
"""

from __future__ import annotations

import contextlib

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Record(dict):
    """A dict with attribute access.

    Module outputs are dicts rather than dataclasses because DeepSpeed ZeRO-3 hooks the tensors it
    finds inside tuples, lists and dicts only; a tensor hidden in a dataclass escapes its backward
    bookkeeping ("active_backward_submodules is empty during backward pass").
    """

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


class Boundaries(Record):
    """What a strategy decided for a batch of byte sequences.

    ``starts``: bool [B, T], True where a chunk starts. Always True at t = 0 and False at padding.
    ``log_probs``: float [B, T], log pi(b_t) of the decision taken, for score-function strategies.
    ``probs``: float [B, T], the boundary probability p_t, where the strategy has one.
    ``gate``: float [B, T] or None, a straight-through multiplier applied to the upsampled chunk
        output at every byte (forward value 1); lets relaxed strategies pass gradients.
    ``smooth``: float [B, T] or None, a per-byte smoothing coefficient P_t in [0, 1]. When set, the
        model smooths the main network's chunk outputs with an EMA over chunks before upsampling:
        z_j = P_j zhat_j + (1 - P_j) z_{j-1}, P_j = ``smooth`` at chunk j's start (H-Net's
        dechunking). Per byte, not per chunk, so it stays valid when ``starts`` is overridden.
    ``extra``: anything the strategy wants back in ``loss`` (e.g. its logits).
    ``forced``: bool [B, T], the starts no strategy decides (see BoundaryStrategy); set on every call.
    ``resets``: the same tensor when the caller passed one (document masking: sequential state such
    as discounted returns restarts there), None when t = 0 is the only forced start.
    """

    def __init__(self, starts: torch.Tensor, log_probs: torch.Tensor | None = None,
                 probs: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                 extra: dict | None = None, smooth: torch.Tensor | None = None):
        super().__init__(starts=starts, log_probs=log_probs, probs=probs, gate=gate, smooth=smooth,
                         extra=extra or {}, forced=None, resets=None)


_ROW_SEEDS: list = [None]  # the seeds of the rows being evaluated (row_seeds), or the draws (given_noise)


def own_lr(model: torch.nn.Module) -> bool:
    """Whether the model's boundary strategy sets its parameters' learning rate itself (lr_factor)."""
    boundary = getattr(model, "boundary", None)  # the BPE token model has none
    return boundary is not None and boundary.lr_factor(0) is not None and any(True for _ in boundary.parameters())


@contextlib.contextmanager
def row_seeds(seeds: list[int]):
    """Within this block uniform_noise draws each row of a batch from its own seed (evaluation: a
    document's boundaries then depend on the document and the seed, not on its batch)."""
    _ROW_SEEDS[0] = list(seeds)
    try:
        yield
    finally:
        _ROW_SEEDS[0] = None


@contextlib.contextmanager
def given_noise(noise: torch.Tensor):
    """Within this block uniform_noise returns the first T columns of ``noise`` [B, >= T] instead of
    drawing (generation: each row's draws from its own stream, by position)."""
    _ROW_SEEDS[0] = noise
    try:
        yield
    finally:
        _ROW_SEEDS[0] = None


def uniform_noise(like: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """U[0, 1) noise shaped, typed and placed like ``like`` [B, T]: what a strategy samples its
    boundaries with. torch.rand_like(like) normally; inside :func:`row_seeds`, row i comes from its
    own generator, drawn at length max(T, ``length``) (the strategy's window) and cut to T, so a row
    gets the same numbers whatever the batch's padded width; inside :func:`given_noise`, the noise given."""
    seeds = _ROW_SEEDS[0]
    if seeds is None:
        return torch.rand_like(like)
    B, T = like.shape
    if isinstance(seeds, torch.Tensor):
        if seeds.shape[0] != B or seeds.shape[1] < T:
            raise ValueError(f"given_noise holds {tuple(seeds.shape)} draws for a [{B}, {T}] batch")
        return seeds[:, :T].to(like.device, like.dtype)
    if len(seeds) != B:
        raise ValueError(f"row_seeds has {len(seeds)} seeds for a batch of {B} rows")
    n = max(T, length or T)
    rows = [torch.rand(n, generator=torch.Generator().manual_seed(s))[:T] for s in seeds]
    return torch.stack(rows).to(like.device, like.dtype)


class BoundaryStrategy(nn.Module):
    """Base class. ``mask`` is bool [B, T], True at real (non-padding) bytes. ``forced`` is bool
    [B, T], True where a chunk must start whatever the strategy thinks: t = 0, and with document
    masking (model.document_mask) every SEP, the first position of a packed document. A strategy
    takes no decision there (no gradient, no policy term), and nothing at or after a forced start
    may depend on what came before it: the forced starts cut the window into independent pieces.

    A strategy initialises its own parameters (the model leaves them alone), through
    :func:`initialise` when it changes a child module's defaults."""

    #: "sample" draws boundaries; "threshold" uses p > 0.5. Strategies without probabilities ignore
    #: it. The trainer sets it for evaluation.
    eval_mode: str = "sample"
    #: The training window (data.seq_len), set by megatok.model.build_model (None when the model is
    #: built otherwise). Evaluation windows are at most this long, padded to the widest in their batch;
    #: a strategy whose draw depends on the length (uniform) draws over this one, not the batch's.
    window: int | None = None
    #: The optimizer step being trained (0 before the first), set by the trainer before each forward,
    #: for strategies with schedules. Restored with the trainer's step on a resume, so never saved.
    step: int = 0
    #: How far back a decision reads: the one at t depends on positions t - reach .. t only (their states,
    #: bytes and noise, and whether t is a forced start); None: on anything before t in the window.
    #: Generation then decides a new byte over its last reach + 2 positions rather than the whole window.
    reach: int | None = None
    #: Boundary samples per training sequence: the model runs each training sequence this many times
    #: (rows i*samples .. i*samples + samples - 1 of the batch the strategy sees) and reports each
    #: sequence's statistics once, averaged over its samples.
    samples: int = 1

    def __init__(self, *, d_model: int, target_rate: float, options: BaseModel):
        super().__init__()
        self.d_model, self.target_rate, self.options = d_model, target_rate, options
        self.samples = self.samples_per_sequence(options)

    # What the rest of megatok asks of a strategy from its config alone (the config's ``boundary.options``
    # is this strategy's ``Options`` instance), before or without building it. Each has a default here; a
    # strategy overrides what its options change.

    @classmethod
    def check_config(cls, options: BaseModel, cfg, world_size: int) -> None:
        """Raise ValueError, one line naming the ``boundary.*`` keys, where ``options`` cannot train under
        the config ``cfg`` on ``world_size`` ranks (checked when the config loads, before any process group)."""

    @classmethod
    def param_count(cls, options: BaseModel, *, d_model: int, target_rate: float) -> int:
        """The strategy's parameters at width ``d_model``: by default counted on the strategy built on the
        meta device (no memory); a strategy with a formula overrides it."""
        with torch.device("meta"):
            built = cls(d_model=d_model, target_rate=target_rate, options=options)
        return sum(p.numel() for p in built.parameters())

    @classmethod
    def flops_per_byte(cls, options: BaseModel, *, d_model: int, target_rate: float) -> float:
        """Forward FLOPs per byte of the strategy's own layers, 2 per parameter each time it is used (a
        weight's multiply-add; a bias counted alike): by default 2 x its parameters, each used once per
        byte, as by a linear head."""
        return 2.0 * cls.param_count(options, d_model=d_model, target_rate=target_rate)

    @classmethod
    def samples_per_sequence(cls, options: BaseModel) -> int:
        """Boundary samples per training sequence (see ``samples``): how many times the model runs
        everything after the encoder on each training sequence."""
        return 1

    @classmethod
    def model_files(cls, options: BaseModel) -> dict[str, str]:
        """The files the strategy reads besides its weights, by option name (a tokenizer): checkpoints
        record their digests, so a file replaced at the same path is noticed."""
        return {}

    def lr_factor(self, step: int) -> float | None:
        """The learning rate of the strategy's own parameters at optimizer step ``step`` (0 for the first
        update) relative to the model's, or None where they follow the model's schedule (the default; then
        the optimizer keeps no separate parameter group for them). A strategy that returns a number for
        some options returns one for every step under them."""
        return None

    @property
    def holds_lr(self) -> bool:
        """With lr_factor: whether the strategy's own learning rate holds at the model's peak after warmup
        (times lr_factor) instead of following the model's decay."""
        return bool(getattr(self.options, "lr_hold", False))

    @property
    def reads_earlier_decisions(self) -> bool:
        """Whether a sampled decision depends on the decisions sampled before it (then generation, which
        holds earlier decisions fixed, uses the threshold rule)."""
        return False

    def __call__(self, h: torch.Tensor, x: torch.Tensor, mask: torch.Tensor,
                 forced: torch.Tensor | None = None) -> Boundaries:
        """``forced`` defaults to t = 0 only; the result records it as ``forced`` (and, when given, as
        ``resets``) for ``loss``. Knowing there is nothing past t = 0 without looking at the tensor
        spares a host sync per step."""
        resets = forced
        if forced is None:
            forced = forced_starts(x, mask, None)
        b = super().__call__(h, x, mask, forced)
        b.forced, b.resets = forced, resets
        return b

    def forward(self, h: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, forced: torch.Tensor) -> Boundaries:
        raise NotImplementedError

    def taken(self, b: Boundaries, starts: torch.Tensor) -> None:
        """The starts the model actually used, ``starts`` [B, T] (a subset of ``b.starts``: the packed layout
        drops those past its length, model.pack_chunks): ``b`` updated to describe those decisions (a strategy
        with log-probabilities gives the ones of the decisions taken)."""
        b.starts = starts

    def loss(self, b: Boundaries, ce_full: torch.Tensor, ce_early: torch.Tensor,
             mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Training terms, each a scalar added to the total loss. ``ce_*`` are per-byte [B, T]."""
        return {}


def initialise(module: nn.Module, fn) -> None:
    """Run ``fn(module)`` to set ``module``'s own parameters, in a strategy's ``__init__``, instead of
    calling nn.init on a child's parameters directly. Under ZeRO-3 construction (deepspeed.zero.Init)
    a child module is partitioned as soon as it is built, and a direct call would silently write to
    an empty tensor; ``Module.apply`` is what zero.Init gathers the parameters around."""
    module.apply(lambda m: fn(m) if m is module else None)


def straight_through(c: torch.Tensor) -> torch.Tensor:
    """Forward value exactly 1, gradient of ``c``: 1 + c - stopgrad(c)."""
    return 1 + (c - c.detach())


def finalize_starts(starts: torch.Tensor, mask: torch.Tensor, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Force a chunk start at t = 0 and at ``forced``, and none on padding."""
    starts = starts & mask
    if forced is not None:
        starts = starts | (forced & mask)
    starts[:, 0] = True
    return starts


def forced_starts(x: torch.Tensor, mask: torch.Tensor, sep: int | None) -> torch.Tensor:
    """bool [B, T]: t = 0, and every real position holding ``sep`` (None: t = 0 only)."""
    forced = torch.zeros_like(mask)
    if sep is not None:
        forced = (x == sep) & mask
    forced[:, 0] = True
    return forced


def since_forced(forced: torch.Tensor) -> torch.Tensor:
    """long [B, T]: t minus the position of the latest forced start at or before t."""
    t = torch.arange(forced.shape[1], device=forced.device)
    last = torch.where(forced, t, torch.zeros_like(t)).cummax(1).values
    return t - last
