"""Tensor-parallel communication overlapped with the matmuls that depend on it (collective matmuls).

With sequence parallelism a block enters each tensor-parallel region by all-gathering its input
along the sequence and leaves it by reduce-scattering the row-parallel product: as plain
collectives, nothing can run while they move s x b x h values. Decomposed into t ring steps of
one sequence chunk each, every step's transfer runs while the matmul of the chunk at hand does
(Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models"; Megatron-LM's TP comm overlap and torchtitan's async TP do the same):

    all-gather -> matmul   rank i holds chunk i; at step k it multiplies the chunk it holds,
                           (i - k) mod t, by every weight that reads the gathered input (wq, wk,
                           wv, or w1 and w3: the region's consumers, one ring for all of them),
                           while passing that chunk to rank i + 1 and receiving chunk
                           (i - k - 1) mod t from rank i - 1.
    matmul -> reduce-scatter   at step k rank i computes the partial product of chunk
                           c = (i - k - 1) mod t, adds the partial sum of c that rank i - 1 sent,
                           and passes it on while computing the next chunk's; at step t - 1,
                           c = i: the sum is its own output chunk.

Each is the other's conjugate in backward: the input gradient of all-gather -> matmul is a
matmul -> reduce-scatter of sum_j dY_j W_j, and the output gradient of matmul -> reduce-scatter
comes back by an all-gather -> matmul of dY (with dW accumulated chunk by chunk). Messages go
through comm/p2p.py on the tensor-parallel group, posted as a send to the next rank and a
receive from the previous one together, so the ring never deadlocks.

Sums run in ring order instead of the backend's, so results equal plain TP + SP to floating-point
summation order (the parity tests' TP tolerance).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.comm.p2p import Ranks, post
from fivefold.model.layers import matmul_dtype
from fivefold.reliability.activity import phase

SEQ_DIM = 1  # activations are (batch, seq, hidden)


def _ring_step(outgoing: torch.Tensor, incoming: torch.Tensor, ranks: Ranks):
    """Post a send of `outgoing` to the next rank and a receive into `incoming` from the previous one."""
    i, t = ranks.index, ranks.size
    return post([("send", outgoing, (i + 1) % t), ("recv", incoming, (i - 1) % t)], ranks)


def _wait(handles, what: str) -> None:
    with phase(f"tensor-parallel {what} (overlapped)", comm=True):
        for handle in handles:
            handle.wait()


def ring_gather(local: torch.Tensor, ranks: Ranks, use: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
    """All-gather `local` along a new first dimension over the ring, calling use(c, chunk c) on each chunk as it is
    held (its own first) while the next one travels; returns the gathered (t, *local.shape)."""
    t, i = ranks.size, ranks.index
    gathered = local.new_empty((t, *local.shape))
    gathered[i] = local
    for k in range(t):
        c = (i - k) % t
        handles = _ring_step(gathered[c], gathered[(c - 1) % t], ranks) if k < t - 1 else []
        use(c, gathered[c])
        _wait(handles, "all-gather")
    return gathered


def gather_matmul(x_local: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                  ranks: Ranks) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[F.linear(all_gather(x_local), W_j, b_j)] with the gather decomposed over the ring; also the gathered x."""
    batch, chunk, hidden = x_local.shape
    outs = [x_local.new_empty((batch, ranks.size * chunk, w.shape[0])) for w in weights]

    def multiply(c: int, x: torch.Tensor) -> None:
        for out, weight, bias in zip(outs, weights, biases):
            out[:, c * chunk : (c + 1) * chunk] = F.linear(x, weight, bias)

    gathered = ring_gather(x_local, ranks, multiply)
    return outs, gathered.permute(1, 0, 2, 3).reshape(batch, ranks.size * chunk, hidden)


def matmul_scatter(partial_of: Callable[[int], torch.Tensor], chunks: int, like: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Reduce-scatter along the sequence of a product computed chunk by chunk: `partial_of(c)` is this rank's
    partial product for sequence chunk c; returns the sum over the ring of chunk `ranks.index`."""
    t, i = ranks.size, ranks.index
    partial = partial_of((i - 1) % t)
    received = torch.empty_like(like)
    for k in range(t - 1):
        handles = _ring_step(partial.contiguous(), received, ranks)
        following = partial_of((i - k - 2) % t)  # the next chunk's product, while this one travels
        _wait(handles, "reduce-scatter")
        partial = following + received
        received = torch.empty_like(like)
    return partial


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


class _GatherMatmul(torch.autograd.Function):
    """Forward: all-gather -> matmul for n weights; backward: matmul -> reduce-scatter of the input gradient."""

    @staticmethod
    def forward(ctx, x_local, ranks, n, *params):
        dtype = matmul_dtype(x_local)
        ctx.dtypes = [p.dtype if p is not None else None for p in params]
        weights, biases = [_cast(w, dtype) for w in params[:n]], [_cast(b, dtype) for b in params[n:]]
        with torch.autocast(x_local.device.type, enabled=False):
            outs, gathered = gather_matmul(x_local.to(dtype), weights, biases, ranks)
        ctx.ranks, ctx.n, ctx.chunk, ctx.input_dtype = ranks, n, x_local.shape[SEQ_DIM], x_local.dtype
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(gathered, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        gathered, *weights = ctx.saved_tensors
        chunk, ranks = ctx.chunk, ctx.ranks
        grads = [torch.zeros_like(gathered[..., :1]).expand(*gathered.shape[:-1], w.shape[0]) if g is None
                 else g.to(gathered.dtype) for g, w in zip(grads, weights)]

        def partial_of(c: int) -> torch.Tensor:
            rows = slice(c * chunk, (c + 1) * chunk)
            return sum(g[:, rows] @ w for g, w in zip(grads, weights))

        x_grad = matmul_scatter(partial_of, ranks.size, gathered[:, :chunk], ranks)
        flat_x = gathered.reshape(-1, gathered.shape[-1])
        n = ctx.n
        weight_grads = [(g.reshape(-1, g.shape[-1]).t() @ flat_x).to(d) for g, d in zip(grads, ctx.dtypes[:n])]
        bias_grads = [g.sum(dim=(0, 1)).to(d) if has else None for g, has, d in zip(grads, ctx.has_bias, ctx.dtypes[n:])]
        return (x_grad.to(ctx.input_dtype), None, None, *weight_grads, *bias_grads)


class _MatmulScatter(torch.autograd.Function):
    """Forward: matmul -> reduce-scatter (row-parallel exit); backward: all-gather -> matmul of the gradient."""

    @staticmethod
    def forward(ctx, x, weight, ranks):
        t = ranks.size
        chunk = x.shape[SEQ_DIM] // t
        dtype = matmul_dtype(x)
        ctx.dtypes = (x.dtype, weight.dtype)
        x, weight = x.to(dtype), weight.to(dtype)

        def partial_of(c: int) -> torch.Tensor:
            return F.linear(x[:, c * chunk : (c + 1) * chunk], weight)

        with torch.autocast(x.device.type, enabled=False):
            out = matmul_scatter(partial_of, t, x.new_empty((x.shape[0], chunk, weight.shape[0])), ranks)
        ctx.ranks, ctx.chunk = ranks, chunk
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        chunk = ctx.chunk
        x_grad = torch.empty_like(x)
        weight_grad = torch.zeros_like(weight)

        def use(c: int, grad_chunk: torch.Tensor) -> None:
            rows = slice(c * chunk, (c + 1) * chunk)
            x_grad[:, rows] = grad_chunk @ weight
            weight_grad.add_(grad_chunk.reshape(-1, grad_chunk.shape[-1]).t() @ x[:, rows].reshape(-1, x.shape[-1]))

        ring_gather(grad.to(x.dtype).contiguous(), ctx.ranks, use)
        return x_grad.to(ctx.dtypes[0]), weight_grad.to(ctx.dtypes[1]), None


class SharedGather:
    """The column-parallel layers that read one region's gathered input (wq, wk, wv or w1, w3): the first
    call with an input runs one ring for all of them; the others take their output from it."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.members: list[nn.Module] = []
        self.input: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def output(self, member: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.input is not x or id(member) not in self.outputs:
            params = [m.effective_parameters() for m in self.members]
            outs = _GatherMatmul.apply(x, self.ranks, len(params), *(w for w, _ in params), *(b for _, b in params))
            self.input, self.outputs = x, {id(m): out for m, out in zip(self.members, outs)}
        out = self.outputs.pop(id(member))
        if not self.outputs:
            self.input = None  # every consumer served: hold nothing past the region
        return out


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Row-parallel output, reduce-scattered along the sequence, overlapped chunk by chunk."""
    return _MatmulScatter.apply(x, weight, ranks)
