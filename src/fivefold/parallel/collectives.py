"""Collective helpers shared by the parallel folds.

`conjugate_function` makes a communication step differentiable: an autograd function that runs
one collective forward and its conjugate backward (Megatron's f/g regions, Ulysses' all-to-alls).

`all_gather_flat` / `reduce_scatter_flat`: flat-tensor all-gather and reduce-scatter under the
names the installed torch prefers (comm/native.py).
"""

import torch

from fivefold.comm.native import all_gather_flat, reduce_scatter_flat

__all__ = ["all_gather_flat", "conjugate_function", "reduce_scatter_flat"]


def conjugate_function(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function that is `forward(x, group)` one way and `backward(grad, group)` back."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
