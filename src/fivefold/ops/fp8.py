"""FP8 linear layers with current (dynamic) per-tensor scaling: e4m3 forward, e5m2 gradients.

Micikevicius et al. 2022 ("FP8 Formats for Deep Learning"): activations and weights in e4m3 (max
448, more mantissa), gradients in e5m2 (max 57344, more range). Each operand is scaled by
fmax / amax(tensor) before the cast, so its largest value lands at the format's largest, and the
product is unscaled by the inverse scales (torchao's "tensorwise" recipe with current scaling: the
amax is the tensor's own, taken just before the cast, rather than a history as in delayed scaling).

The three matmuls of a linear layer y = x W^T:

    forward        y  = q4(x) q4(W)^T
    input grad     dx = q5(dy) q4(W)
    weight grad    dW = q5(dy)^T q4(x)

On a GPU with FP8 tensor cores (compute capability 8.9 or 9.0+) these run through
`torch._scaled_mm` (cuBLASLt FP8 GEMM, fp32 accumulation); elsewhere, or for shapes it does not take
(dimensions not multiples of 16), the same quantised values are multiplied in fp32: identical
inputs to the product, so the CPU emulation differs from the GPU only in summation order. The
master weights stay in fp32 and the optimizer never sees FP8. Parameters keep their names: the
layer is swapped, the weight Parameter object is the same one.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.model.layers import matmul_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x scaled so amax lands at the format's max and cast to `dtype`, the fp32 inverse scale)."""
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().max().float().clamp(min=1e-12)
    scale = fmax / amax
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def _fast_path(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.is_cuda and b.is_cuda) or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    return all(n % 16 == 0 for n in (*a.shape, b.shape[1]))


def scaled_matmul(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(a a_inv) @ (b b_inv) from FP8 operands a (m, k) and b (k, n), accumulated in fp32."""
    if _fast_path(a, b):
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv,
                                out_dtype=out_dtype)
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype):
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_inv = quantize(x2, E4M3)
        w8, w_inv = quantize(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        y = scaled_matmul(x8, x_inv, w8.t(), w_inv, out_dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        g8, g_inv = quantize(grad.reshape(-1, grad.shape[-1]), E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_matmul(g8, g_inv, w8, w_inv, grad.dtype).reshape(ctx.shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_matmul(g8.t(), g_inv, x8, x_inv, torch.float32).to(ctx.w_dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with its three matmuls in FP8; output in the autocast dtype when autocast is on."""
    out_dtype = matmul_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        y = _Float8Matmul.apply(x, weight, out_dtype)
        return y if bias is None else y + bias.to(out_dtype)


class Float8Linear(nn.Module):
    """An nn.Linear whose matmuls run in FP8 (same weight and bias Parameters)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


def apply_fp8(model: nn.Module) -> int:
    """Swap every nn.Linear inside the transformer blocks for Float8Linear; returns how many.

    The output head (vocabulary-sized and sensitive), the embedding, the MoE router and gates
    (tiny, and routing decisions are discrete) stay in higher precision, as in torchao's recipe.
    """
    swapped = 0
    for block in model.layers.values():
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name not in ("router", "shared_gate"):
                    setattr(parent, name, Float8Linear(child))
                    swapped += 1
    return swapped



