"""Collective helpers shared by the parallel folds.

`conjugate_function` makes a communication step differentiable: an autograd function that runs
one collective forward and its conjugate backward (Megatron's f/g regions, Ulysses' all-to-alls).

`all_gather_flat` / `reduce_scatter_flat`: flat-tensor all-gather and reduce-scatter under the
names the installed torch prefers. torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and deprecates the old names; fivefold supports torch >= 2.5, so both
ZeRO and tensor parallelism take them from here.
"""

import torch
import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def conjugate_function(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function that is `forward(x, group)` one way and `backward(grad, group)` back."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
