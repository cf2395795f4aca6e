"""The trainer's training step without DeepSpeed, for the measurements that time the model alone
(megatok-bench, and megatok-gpu-check where DeepSpeed is not installed): AdamW over the trainer's
parameter groups (megatok.train.engine.param_groups: weight decay on matrices only), and one step of
forward, backward, gradient clipping and update, under bf16 autocast where asked."""

from __future__ import annotations

import torch

from megatok.config import TrainConfig
from megatok.train.engine import param_groups


def adamw(model: torch.nn.Module, train: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """train.lr, betas, eps and weight_decay as the trainer sets them; fused on a GPU."""
    return torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, betas=train.betas, eps=train.eps,
                             fused=device.type == "cuda")


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, *, grad_clip: float,
               bf16: bool):
    """One step on a [B, T+1] batch (inputs tokens[:, :-1], targets tokens[:, 1:]): the model's output."""
    device_type = tokens.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        out = model(tokens[:, :-1], tokens[:, 1:])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out
