"""Named model shapes: CPU demo sizes and the exact shapes of Llama 3 and GPT-3 175B.

Llama 3 shapes are from Meta's model cards / params.json (Dubey et al. 2024, Table 3).
`gpt3-175b` keeps GPT-3's h=12288, L=96, a=96, V=50257, s=2048 and tied embeddings
(Brown et al. 2020) but, being a Llama-style block, uses SwiGLU with ffn = 8h/3 so the
MLP has GPT-3's 8h^2 parameters.
"""

from __future__ import annotations

import dataclasses
import difflib

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", dim=256, n_layers=6, n_heads=8, n_kv_heads=4, multiple_of=64, max_seq_len=1024, rope_theta=10000.0
    ),
    "small": ModelConfig(
        name="small", dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256, max_seq_len=2048
    ),
    "llama3-8b": ModelConfig(
        name="llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=1024, ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.2, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
    ),
    "gpt3-175b": ModelConfig(
        name="gpt3-175b", dim=12288, n_layers=96, n_heads=96, vocab_size=50257, ffn_dim=32768,
        max_seq_len=2048, tie_embeddings=True,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a preset's ModelConfig."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}{hint}")
    return dataclasses.replace(PRESETS[name])
