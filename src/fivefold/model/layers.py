"""Building blocks shared by the model's modules: RMSNorm, rotary embeddings, the causal (window) mask, SwiGLU.

RMSNorm (Zhang & Sennrich 2019) in fp32 like the reference Llama; RoPE (Su et al. 2021) in the
half-split ("rotate_half") convention of GPT-NeoX and Hugging Face.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x runs in: autocast's where it is on for x's device, else x's own (for code that casts
    by hand what autocast does not: custom autograd functions, torch._grouped_mm, torch._scaled_mm)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, computed in fp32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with its gain: weight * rms_normalize(x)."""
    return weight * rms_normalize(x, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's pointwise part: silu(gate) * up."""
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 like the reference Llama."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # a block built alone (plan/ring_host.py) is a valid one

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, heads, seq, head_dim) by the angles of its positions."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


def attention_mask(seq: int, past: int, window: int, device) -> torch.Tensor | None:
    """Boolean (seq, past + seq) mask: query i (absolute position past + i) sees keys j with
    j <= past + i and, with a sliding window w > 0, past + i - j < w. None when plain causal
    attention over a fresh sequence says the same (SDPA's is_causal is faster)."""
    if past == 0 and (window == 0 or window >= seq):
        return None
    mask = torch.ones(seq, past + seq, dtype=torch.bool, device=device).tril(diagonal=past)
    if window and window < past + seq:
        mask = mask.triu(diagonal=past - window + 1)
    return mask


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))
