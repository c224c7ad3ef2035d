"""Named model shapes: CPU demo sizes and the exact shapes of published models.

Llama 3 shapes are from Meta's model cards / params.json (Dubey et al. 2024, Table 3); Llama
3.1 adds the `llama3` RoPE scaling (factor 8 over an 8192 context) and Llama 3.2 1B/3B tie their
embeddings (factor 32). Qwen2.5, Qwen3 and Mistral shapes are those of their published
config.json files (Qwen2.5-7B, Qwen3-8B/32B, Mistral-7B-v0.1). The mixture-of-experts shapes are
those of Mixtral-8x7B-v0.1, Qwen1.5-MoE-A2.7B (Qwen2-MoE architecture: 60 experts, a gated shared
expert) and Qwen3-30B-A3B; `deepseek-v3` is DeepSeek-V3's main model (multi-latent attention, 3 dense
layers, 256 sigmoid-routed experts in 8 groups of which each token may use 4, plus a shared one, YaRN
to 163,840 positions with its mscale, as its config.json; without the multi-token-prediction module);
`tiny-moe` is the CPU demo
(configs/tiny-moe.toml).
`gpt3-175b` keeps GPT-3's h=12288, L=96, a=96, V=50257, s=2048 and tied embeddings
(Brown et al. 2020) but, being a Llama-style block, uses SwiGLU with ffn = 8h/3 so the
MLP has GPT-3's 8h^2 parameters.
"""

from __future__ import annotations

import dataclasses
import difflib

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig

_LLAMA31_ROPE = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=8192)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", dim=256, n_layers=6, n_heads=8, n_kv_heads=4, multiple_of=64, max_seq_len=1024, rope_theta=10000.0
    ),
    "tiny-moe": ModelConfig(
        name="tiny-moe", dim=256, n_layers=6, n_heads=8, n_kv_heads=4, multiple_of=64, max_seq_len=1024,
        n_experts=8, moe_top_k=2, moe_ffn_dim=256, moe_shared_experts=1, moe_aux_loss="switch", moe_aux_coeff=0.01,
        moe_z_loss_coeff=0.001,
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
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=1024, ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, **_LLAMA31_ROPE,
    ),
    "llama3.1-70b": ModelConfig(
        name="llama3.1-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, **_LLAMA31_ROPE,
    ),
    "llama3.1-405b": ModelConfig(
        name="llama3.1-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.2, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, **_LLAMA31_ROPE,
    ),
    "llama3.2-1b": ModelConfig(
        name="llama3.2-1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True, **{**_LLAMA31_ROPE, "rope_factor": 32.0},
    ),
    "llama3.2-3b": ModelConfig(
        name="llama3.2-3b", dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True, **{**_LLAMA31_ROPE, "rope_factor": 32.0},
    ),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b", dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, ffn_dim=18944,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=131072, attention_bias="qkv",
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=151936, ffn_dim=12288,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm="head",
    ),
    "qwen3-32b": ModelConfig(
        name="qwen3-32b", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, vocab_size=151936, ffn_dim=25600,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm="head",
    ),
    "mistral-7b": ModelConfig(
        name="mistral-7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=14336,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768, sliding_window=4096,
    ),
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=14336,
        norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768, n_experts=8, moe_top_k=2, moe_aux_loss="switch",
        moe_aux_coeff=0.02,
    ),
    "qwen1.5-moe-a2.7b": ModelConfig(
        name="qwen1.5-moe-a2.7b", dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=151936, ffn_dim=5632,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=8192, attention_bias="qkv", n_experts=60, moe_top_k=4,
        moe_ffn_dim=1408, moe_shared_ffn_dim=5632, moe_shared_gate=True, moe_norm_topk=False, moe_aux_loss="switch",
        moe_aux_coeff=0.001,
    ),
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
        ffn_dim=6144, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, qk_norm="head", n_experts=128,
        moe_top_k=8, moe_ffn_dim=768, moe_aux_loss="switch", moe_aux_coeff=0.001,
    ),
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_dim=18432, norm_eps=1e-6,
        rope_theta=10000.0, max_seq_len=163840, rope_scaling="yarn", rope_factor=40.0, rope_original_max_seq_len=4096,
        rope_attention_factor=1.0, rope_mscale_all_dim=1.0, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=256, moe_top_k=8, moe_ffn_dim=2048,
        moe_shared_experts=1, moe_first_dense=3, moe_score="sigmoid", moe_norm_topk=True, moe_route_scale=2.5,
        moe_groups=8, moe_topk_groups=4, moe_aux_loss="sequence", moe_aux_coeff=0.0001, moe_bias_update_rate=0.001,
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
