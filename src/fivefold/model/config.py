"""Shape of a Llama-style decoder, and the arithmetic that follows from it.

`ffn_hidden_dim` follows Llama's rule: 2/3 of 4*dim, times an optional multiplier,
rounded up to a multiple of `multiple_of` (Touvron et al. 2023; Llama 3 uses 1.3 and 1024
for 8B, which gives 14336).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "custom"
    """Label shown in logs; set by presets."""
    dim: int = 256
    """Hidden size h."""
    n_layers: int = 6
    """Transformer blocks L."""
    n_heads: int = 8
    """Query heads a."""
    n_kv_heads: int = 0
    """Key/value heads (GQA); 0 means n_heads (MHA); 1 is MQA."""
    vocab_size: int = 0
    """Vocabulary size V; 0 takes the tokenizer's."""
    ffn_dim: int = 0
    """SwiGLU hidden size; 0 applies Llama's rule with multiple_of / ffn_dim_multiplier."""
    multiple_of: int = 64
    """Llama's ffn rule rounds the hidden size up to a multiple of this."""
    ffn_dim_multiplier: float = 1.0
    """Llama's ffn rule multiplier (1.3 for Llama-3 8B/70B, 1.2 for 405B)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency (500000 for Llama 3)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections get init_std / sqrt(2 * n_layers)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier != 1.0:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} = {getattr(self, name)}: must be a positive integer")
        for name in ("n_kv_heads", "vocab_size", "ffn_dim"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} = {getattr(self, name)}: must be >= 0 (0 means automatic)")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim = {self.dim} is not divisible by model.n_heads = {self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} (model.dim / model.n_heads) must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads = {self.n_heads} is not a multiple of model.n_kv_heads = {self.kv_heads}: "
                "each key/value head must serve a whole group of query heads"
            )
        for name in ("norm_eps", "rope_theta", "init_std", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"model.{name} = {value}: must be a positive finite number")
