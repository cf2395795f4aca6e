"""The engine: the model under DeepSpeed (ZeRO stage, bf16, accumulation, clipping from the config's
``deepspeed`` and ``train`` sections), its AdamW optimizer and megatok's learning-rate schedule."""

from __future__ import annotations

from typing import Callable

import torch

from megatok.boundaries.base import own_lr
from megatok.config import Config, TrainConfig
from megatok.dsconfig import builds_partitioned, zero_stage
from megatok.model import build_model
from megatok.model.blocks import Block, compile_blocks, compile_training_forward


def build(cfg: Config, ds_config: dict, device: torch.device | None = None) -> torch.nn.Module:
    """The model, built under ``deepspeed.zero.Init`` for ZeRO-3 (unless train.zero_init is off): each
    module is partitioned over the ranks as soon as it is built, so no rank, and no host, ever holds
    the whole model. The random draws are those of a plain build (tests/train/test_zero_init.py); on a
    GPU they are made on the device. Under ZeRO 0-2 every rank holds the whole working copy anyway: on
    a GPU it is built there directly (fp32, then cast by the engine), not on the host first, so a node
    needs no host RAM for 8 whole fp32 models at start-up."""
    import deepspeed

    if builds_partitioned(cfg):
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build_model(cfg)
    elif device is not None and device.type != "cpu":
        with torch.device(device):
            model = build_model(cfg)
    else:
        model = build_model(cfg)
    if cfg.train.compile:
        compile_model(model, cfg)
    return model


def compile_model(model: torch.nn.Module, cfg: Config) -> int:
    """train.compile 'model': the whole training forward (megatok.model.blocks.compile_training_forward); else
    every transformer block through torch.compile (megatok.model.blocks.compile_blocks).
    Under ZeRO-3 each block is first made a ZeRO-3 leaf module, before the engine puts its hooks on
    the model: its parameters are gathered in one hook around the block instead of one per layer
    inside it, where every hook would split the compiled block into per-layer graphs. Returns how
    many blocks.

    Under ZeRO-3 dynamo also takes integer attributes of modules as unspecialised: DeepSpeed's ZeRO-3 linear
    reads each parameter's ``ds_id`` (through ``hasattr``), and torch 2.11 (the GPU image's) guards on its
    value, so every block of a stack compiled a variant of its own (one per block, past the recompile limit
    at 100m's 20 blocks); with the setting every block shares one, as under torch 2.13
    (tests/train/test_distributed.py counts them)."""
    if cfg.train.compile == "model":
        compile_training_forward(model)
        return 1
    if zero_stage(cfg) == 3:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [Block])
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
    return compile_blocks(model)


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape, also when ZeRO-3 has partitioned it (its data is then an empty tensor)."""
    return getattr(p, "ds_shape", p.shape)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases or the policy's scalar bias). Where the boundary
    strategy sets its own learning rate (own_lr), its parameters are two more groups, last."""
    mine = {id(p) for p in model.boundary.parameters()} if own_lr(model) else set()
    groups = []
    for params in ([p for p in model.parameters() if id(p) not in mine],
                   [p for p in model.parameters() if id(p) in mine]):
        if params:
            groups += [{"params": [p for p in params if len(full_shape(p)) >= 2], "weight_decay": weight_decay},
                       {"params": [p for p in params if len(full_shape(p)) < 2], "weight_decay": 0.0}]
    return groups


def group_schedules(model: torch.nn.Module, schedule: Callable[[int], float], groups: int,
                    warmup_steps: int = 0) -> list[Callable]:
    """The learning-rate factor of each of param_groups' groups: the model's ``schedule``, and for the
    strategy's own groups (the last two, with own_lr) that times the strategy's lr_factor; where the strategy
    holds its rate (holds_lr), the schedule stops at its value after ``warmup_steps`` (its peak)."""
    if not own_lr(model):
        return [schedule] * groups
    boundary = model.boundary
    if boundary.holds_lr:
        return [schedule] * (groups - 2) + [lambda s: schedule(min(s, warmup_steps)) * boundary.lr_factor(s)] * 2
    return [schedule] * (groups - 2) + [lambda s: schedule(s) * boundary.lr_factor(s)] * 2


class Engine:
    """A DeepSpeed engine over ``model`` with AdamW (weight decay on matrices) and the LambdaLR
    ``schedule``. It counts the optimizer steps DeepSpeed skips for non-finite gradients and ends the
    run after more than train.max_skipped_steps in a row; that streak is its checkpointed state (the
    model, optimizer and schedule are DeepSpeed's files, written by the checkpointer)."""

    def __init__(self, model: torch.nn.Module, ds_config: dict, train: TrainConfig,
                 schedule: Callable[[int], float]):
        import deepspeed
        from torch.optim.lr_scheduler import LambdaLR

        self.train_cfg, self.schedule = train, schedule
        self.n_params = sum(full_shape(p).numel() for p in model.parameters())
        groups = param_groups(model, train.weight_decay)
        self.schedules = group_schedules(model, schedule, len(groups), train.warmup_steps)
        self.ds, _, _, _ = deepspeed.initialize(model=model, config=ds_config, model_parameters=groups,
                                                lr_scheduler=lambda opt: LambdaLR(opt, self.schedules))
        self.skipped_in_row = 0
        self._skipped_before = 0

    @property
    def zero_stage(self) -> int:
        return self.ds.zero_optimization_stage()

    @property
    def lr(self) -> float:
        return self.ds.get_lr()[0]

    @property
    def grad_norm(self) -> float | None:
        return self.ds.get_global_grad_norm()

    def forward(self, tokens: torch.Tensor):
        """The model's output (loss, terms, stats) on a [B, T+1] batch: inputs tokens[:, :-1], targets tokens[:, 1:]."""
        return self.ds(tokens[:, :-1], tokens[:, 1:])

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, then DeepSpeed's step, which updates only at the accumulation boundary."""
        self.ds.backward(loss)
        self.ds.step()

    def begin_step(self, step: int) -> None:
        """Before the micro-batches of optimizer step ``step`` + 1 (``step`` done so far): strategies with
        schedules read the step from the model's boundary strategy."""
        self._skipped_before = self.ds.skipped_steps
        boundary = getattr(self.ds.module, "boundary", None)  # the BPE token model has none
        if boundary is not None:
            boundary.step = step

    def end_step(self, step: int, nonfinite: bool) -> int:
        """After optimizer step ``step``, given whether any rank saw a non-finite loss: how many updates
        DeepSpeed skipped (ZeRO 1-3 skip an update whose global gradient norm is not finite). ZeRO-0
        cannot skip, so there a non-finite loss ends the run (FloatingPointError) before any save; so
        does a streak of skips longer than train.max_skipped_steps."""
        skipped = self.ds.skipped_steps - self._skipped_before
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        if nonfinite and self.zero_stage == 0:
            raise FloatingPointError(f"non-finite loss at step {step} under ZeRO stage 0, which cannot skip an "
                                     f"update")
        limit = self.train_cfg.max_skipped_steps
        if self.skipped_in_row > limit:
            raise FloatingPointError(f"{self.skipped_in_row} optimizer steps in a row skipped for non-finite "
                                     f"gradients (train.max_skipped_steps={limit}) at step {step}")
        return skipped

    def state_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "precision": "bf16" if self.ds.bfloat16_enabled() else "fp32",
                "skipped_in_row": self.skipped_in_row, "optimizer_groups": len(self.schedules)}

    def load_state_dict(self, state: dict) -> None:
        """After DeepSpeed loaded its states: the streak of skipped steps goes on across the resume, and
        the config's learning rate wins over the one saved in the scheduler, from the next update on."""
        self.skipped_in_row = state["skipped_in_row"]
        sched, lr = self.ds.lr_scheduler, self.train_cfg.lr
        sched.base_lrs = [lr] * len(sched.base_lrs)
        for group, schedule in zip(self.ds.optimizer.param_groups, self.schedules):
            group["lr"] = lr * schedule(max(0, sched.last_epoch))
