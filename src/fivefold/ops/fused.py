"""RMSNorm, RoPE and SwiGLU as fused kernels: torch.compile-generated (Triton on CUDA), eager elsewhere.

Each of the three is a chain of pointwise operations plus (RMSNorm) one row reduction; eager PyTorch
runs one kernel per operation, reading and writing the whole tensor each time: RMSNorm in fp32 is
six passes (cast, square, mean, rsqrt, multiply, multiply by the gain), SwiGLU three (silu,
multiply and the sigmoid inside silu), RoPE five (two products, the half rotation's negate and
concatenate, the sum). Inductor fuses each chain into one kernel that reads its inputs once and
writes its output once, forward and backward. These are the very functions the model runs
(model/layers.py: `rms_norm`, `swiglu`, `apply_rope`), compiled standalone for the parity tests and the kernel benchmark; in training `train.compile`
compiles whole blocks, which generates the same fusions in place (parallel/compile.py).

On a machine without CUDA `fused` returns the eager function unchanged (the fallback): inductor's
CPU backend works, but compiling costs more than these ops save on a CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from fivefold.model.layers import apply_rope, rms_norm, swiglu


def fused(fn: Callable, device: torch.device | str) -> Callable:
    """`fn` compiled into fused kernels on CUDA; `fn` itself elsewhere."""
    if torch.device(device).type != "cuda":
        return fn
    return torch.compile(fn, dynamic=False, fullgraph=True)


OPS: dict[str, Callable] = {"rms_norm": rms_norm, "swiglu": swiglu, "rope": apply_rope}
