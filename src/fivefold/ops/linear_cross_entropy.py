"""The LM head and cross-entropy fused and chunked over tokens, so the full tokens x vocab logits never exist.

The plain head computes logits = h W^T for all N tokens (N x V, and an fp32 copy for the softmax) and
the loss keeps N x V fp32 log-probabilities for backward: at N = 8 x 2048 tokens and Llama 3's V =
128,256 that is 8.4 GB of log-probabilities alone. Here the N tokens are taken `chunk` at a time (the
idea of Liger Kernel's fused linear cross-entropy, Hsu et al. 2024, and of Wijmans et al. 2024's Cut
Cross-Entropy): each chunk's logits are made, reduced to one log-sum-exp and one target logit per
token, and dropped. Backward recomputes them chunk by chunk, turns them into the softmax gradient
(softmax - one-hot) and accumulates dL/dh and dL/dW. What is kept for backward is the head's input,
the weight and 4 bytes per token (the log-sum-exp); the live extra memory is one chunk's logits.

Vocabulary-parallel tensor parallelism (Megatron's parallel cross-entropy) works chunk by chunk the
same way: each rank holds rows [start, start + V/t) of the (padded) weight, the chunk's max, sum of
exponentials and target logit are all-reduced over the group, and padded rows are masked out. dL/dh
is then this rank's partial sum; the tensor-parallel region the head's input came from (its
all-reduce, or sequence parallelism's reduce-scatter) sums it, as it would the plain head's.

The matmuls run in the autocast dtype when autocast is on (as the plain head's would) with the
softmax in fp32; dL/dW is accumulated in fp32 over the chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fivefold.model.layers import matmul_dtype


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """fp32 logits of one chunk over this rank's vocabulary rows, padded rows (>= vocab_size) at -inf."""
    logits = (x @ weight.t()).float()
    if start + weight.shape[0] > vocab_size:
        logits[:, max(vocab_size - start, 0):] = float("-inf")
    return logits


def _target_index(labels: torch.Tensor, start: int, rows: int, ignore_index: int):
    """(this rank holds the label's row, clamped local row index (n, 1), label is not ignored)."""
    valid = labels != ignore_index
    local = labels - start
    mine = valid & (local >= 0) & (local < rows)
    return mine, local.clamp(0, rows - 1).unsqueeze(-1), valid


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, start, vocab_size, group, ignore_index, dtype):
        n, rows = hidden.shape[0], weight.shape[0]
        x, w = hidden.to(dtype), weight.to(dtype)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        mine, index, valid = _target_index(labels, start, rows, ignore_index)
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                logits = _chunk_logits(x[lo:hi], w, start, vocab_size)
                top = logits.max(dim=-1).values
                if group is not None:
                    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                sum_exp = (logits - top.unsqueeze(-1)).exp_().sum(dim=-1)
                if group is not None:
                    dist.all_reduce(sum_exp, group=group)
                lse[lo:hi] = top + sum_exp.log()
                target[lo:hi] = torch.where(mine[lo:hi], logits.gather(-1, index[lo:hi]).squeeze(-1), 0.0)
                del logits
        if group is not None:  # one rank holds each token's target row; the others contributed 0
            dist.all_reduce(target, group=group)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk, ctx.start, ctx.vocab_size, ctx.ignore_index, ctx.dtype = chunk, start, vocab_size, ignore_index, dtype
        return torch.where(valid, lse - target, 0.0).sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors
        n, rows, chunk = hidden.shape[0], weight.shape[0], ctx.chunk
        x, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        mine, index, valid = _target_index(labels, ctx.start, rows, ctx.ignore_index)
        scale = valid.to(torch.float32) * grad_loss.float()
        grad_hidden = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                grad = _chunk_logits(x[lo:hi], w, ctx.start, ctx.vocab_size)
                grad.sub_(lse[lo:hi].unsqueeze(-1)).exp_()  # softmax
                grad.scatter_add_(-1, index[lo:hi], -mine[lo:hi].to(grad.dtype).unsqueeze(-1))
                grad = grad.mul_(scale[lo:hi].unsqueeze(-1)).to(ctx.dtype)
                if grad_hidden is not None:
                    torch.mm(grad, w, out=grad_hidden[lo:hi])
                if grad_weight is not None:
                    grad_weight.add_((grad.t() @ x[lo:hi]).float())
                del grad
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int,
                         vocab_size: int | None = None, group: dist.ProcessGroup | None = None,
                         ignore_index: int = -100, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight^T, labels), `chunk` tokens at a time.

    hidden (..., d), labels (...) and weight (V_local, d): the whole head, or with `group` this
    tensor-parallel rank's rows [rank V_local, (rank + 1) V_local) of the vocabulary padded to a
    multiple of the group size; rows at or past `vocab_size` are padding and never predicted.
    `dtype`: the matmuls' dtype (None: autocast's, if it is on where this is called, else hidden's).
    """
    if chunk < 1:
        raise ValueError(f"chunk = {chunk}: the tokens per chunk must be at least 1")
    rows = weight.shape[0]
    start = 0 if group is None else dist.get_rank(group) * rows
    vocab = rows if vocab_size is None else vocab_size
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk, start,
                                     vocab, group, ignore_index, dtype or matmul_dtype(hidden))
