"""AdamW (Loshchilov & Hutter 2019) with decay on matrices only, and the learning-rate schedule.

The schedule is a pure function of the step: linear warmup from 0 to the peak over
`warmup_steps`, then cosine (or linear) decay to `min_lr_ratio * lr` at the last step, or
constant. Being stateless, it needs nothing in a checkpoint beyond the step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fivefold.config import OptimConfig


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on parameters of two or more dimensions (not norm gains)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return build_adamw(decay, no_decay, config)


def build_adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over explicit decay / no-decay parameter lists (e.g. ZeRO's master shards)."""
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, config.weight_decay), (no_decay, 0.0))
        if params
    ]
    # One fused kernel for every CUDA tensor (PyTorch's fused AdamW); on the CPU (and for host-offloaded
    # ZeRO shards) the multi-tensor foreach implementation. Both compute the same update.
    on_gpu = all(p.is_cuda for p in [*decay, *no_decay])
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
        **({"fused": True} if on_gpu else {"foreach": True}),
    )


def lr_at(step: int, config: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    decay_steps = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.lr * config.min_lr_ratio
    if config.schedule == "linear":
        return config.lr - (config.lr - floor) * progress
    return floor + 0.5 * (config.lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
