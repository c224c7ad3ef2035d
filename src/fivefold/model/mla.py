"""Multi-latent attention (DeepSeek-AI 2024, DeepSeek-V2 §2.1; DeepSeek-V3): keys and values through a low-rank
latent, with a decoupled RoPE key shared by all heads.

    queries   q = W_qb RMSNorm(W_qa x)   (or W_q x when q_lora_rank = 0), per head [q_nope (n) | q_rope (r)]
    latent    [c (kv_lora_rank) | k_rope (r)] = W_kva x;  c = RMSNorm(c)
    keys      per head [W_kvb c -> k_nope (n) | RoPE(k_rope), the same for every head]
    values    per head W_kvb c -> v (v_head_dim)
    output    W_o softmax(q k^T / sqrt(n + r)) v   (x DeepSeek's YaRN factor mscale^2 with rope_mscale_all_dim)

RoPE rotates only the r-wide parts (q_rope and the shared k_rope), in the half-split convention of
the rest of the model. Generation caches the latent [c | RoPE(k_rope)] of every position: kv_lora_rank
+ r values per token and layer instead of 2 x heads x head_dim (`cache_values_per_token`), and
recomputes keys and values from it.

The module is plain PyTorch; tensor parallelism (parallel/tensor_parallel.py) splits W_q / W_qb, W_kvb
and W_o by heads and keeps W_qa, W_kva and the two norms whole.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.config import ModelConfig
from fivefold.model.layers import RMSNorm, apply_rope, attention_mask


def cache_values_per_token(config: ModelConfig) -> int:
    """Values one layer caches per token: MLA's latent and RoPE key, or MHA's keys and values."""
    if config.attention == "mla":
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.kv_heads * config.head_size


def softmax_scale(config: ModelConfig) -> float:
    """1 / sqrt(n + r), times DeepSeek's YaRN correction (0.1 mscale_all_dim ln(factor) + 1)^2 when set."""
    scale = 1.0 / math.sqrt(config.qk_nope_head_dim + config.qk_rope_head_dim)
    if config.rope_mscale_all_dim and config.rope_factor > 1:
        scale *= (0.1 * config.rope_mscale_all_dim * math.log(config.rope_factor) + 1.0) ** 2
    return scale


class MultiLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        qk = self.nope + self.rope
        if config.q_lora_rank:
            self.wq_a = nn.Linear(config.dim, config.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
            self.wq_b = nn.Linear(config.q_lora_rank, config.n_heads * qk, bias=False)
            self.wq = None
        else:
            self.wq = nn.Linear(config.dim, config.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(config.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, config.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, config.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(config.n_heads * self.v_dim, config.dim, bias=False)
        self.scale = softmax_scale(config)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        return self.wq_b(self.q_a_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.queries(x).view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)  # (batch, 1, seq, rope): one key for all heads
        past = 0
        if cache is not None:
            past = cache.lengths[self.layer_id]
            stored, _ = cache.update(self.layer_id, torch.cat([latent.unsqueeze(1), k_rope], dim=-1), k_rope[..., :0])
            latent, k_rope = stored.squeeze(1).split([self.kv_rank, self.rope], dim=-1)
            k_rope = k_rope.unsqueeze(1)
        kv = self.wkv_b(latent).view(batch, latent.shape[1], -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = k_nope.shape[1]
        k = torch.cat([k_nope, k_rope.expand(-1, heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = self.core(q, k, v, past)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0, window: int = 0) -> torch.Tensor:
        """softmax(q k^T / sqrt(n + r) + causal mask) v (a method, so recomputation can wrap it).

        The fused kernels (flash on CPU and GPU) need one head width for q, k and v; with n + r != v_head_dim
        SDPA would fall back to its unfused path, which keeps the heads x s x s probabilities for backward.
        So the narrower side is zero-padded (zeros add nothing to q k^T, and padded value columns give output
        columns that are cut off), as Hugging Face's DeepSeek models do for FlashAttention-2.
        """
        width, value_width = q.shape[-1], v.shape[-1]
        if width < value_width:
            q, k = F.pad(q, (0, value_width - width)), F.pad(k, (0, value_width - width))
        elif value_width < width:
            v = F.pad(v, (0, width - value_width))
        mask = attention_mask(q.shape[2], past, window, q.device)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out[..., :value_width]
