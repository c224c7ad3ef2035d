"""torch.compile applied per transformer block (torchtitan's per-block compilation).

Each block's forward is replaced by its compiled version, after every other fold has rewritten the
block (tensor-parallel layers, context-parallel attention, recomputation wrappers) and before the
data-parallel wrappers install their hooks, which stay eager around it. Compiling blocks rather than
the whole model keeps compile time flat in depth: blocks of one shape share one graph (dynamo inlines
the module, so its parameters are graph inputs, not guards). Inductor fuses each block's pointwise
chains (RMSNorm, RoPE, SwiGLU's SiLU x gate, residual adds) into Triton kernels on CUDA and C++/OpenMP
loops on the CPU; the matmuls stay with cuBLAS / the CPU's BLAS.

The plain loss (no tensor parallelism, no chunked head) is compiled too, as torchtitan's
`compile.components = ["model", "loss"]`: eager cross-entropy on bf16 logits writes their fp32 copy and
then fp32 log-probabilities, which it keeps for backward (4 bytes x tokens x vocab, then the fp32 gradient
on top); compiled, the upcast, log-softmax and gather fuse into one pass that keeps only the logits (in their
own dtype) and a log-sum-exp per token, and backward recomputes the softmax from them.

Shapes are static (`dynamic=False`): a step's micro-batches share one shape, and evaluation under
no_grad gets its own graph once. After those first compiles a run recompiles nothing; the test
checks this through dynamo's counters.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fivefold.parallel.output_loss import cross_entropy_sum


def apply_compile(model: nn.Module) -> None:
    """Compile the forward of every transformer block in place (parameter names do not change)."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, dynamic=False)


def compiled_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`cross_entropy_sum` compiled: (logits, labels) -> summed fp32 token cross-entropy."""
    return torch.compile(cross_entropy_sum, dynamic=False)


def compiled_graphs() -> int:
    """Frames dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
