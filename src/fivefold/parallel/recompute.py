"""Activation recomputation (Chen et al. 2016; selective recomputation, Korthikanti et al. 2022).

    none:       every block keeps what autograd saves for backward.
    full:       each transformer block keeps only its input; its forward runs again in backward.
    selective:  only the attention core (softmax(q k^T) v) is recomputed: it is cheap in FLOPs
                per byte saved, since with a materialised score matrix it holds the s^2 term.

Both use `torch.utils.checkpoint` in its reentrant form, the one Megatron-LM uses: an autograd
function that saves the region's inputs with `save_for_backward` (so they are counted like any
other saved activation, docs/activation_memory.md) and runs the region under no_grad, then
again with grad in backward. It is applied from outside: the block's (or the core's) forward
is replaced on the instance, so module hooks (ZeRO-3 gathers) and parameter names are
untouched. Collectives inside a recomputed region (tensor/sequence parallel) run again in
backward, in the same order on every rank.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fivefold.errors import ConfigError

RECOMPUTE_MODES = ("none", "full", "selective")


def _checkpointed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation, generation: nothing to keep or recompute
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=True, **kwargs)
    return run


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Wrap every block (full) or every attention core (selective) of the model in a checkpoint."""
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute = {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return
    for block in model.layers.values():
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        else:
            block.attention.core = _checkpointed(block.attention.core)
