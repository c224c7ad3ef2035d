"""Shape of a Llama-style decoder, and the arithmetic that follows from it.

`ffn_hidden_dim` follows Llama's rule: 2/3 of 4*dim, times an optional multiplier,
rounded up to a multiple of `multiple_of` (Touvron et al. 2023; Llama 3 uses 1.3 and 1024
for 8B, which gives 14336).

The options beyond plain Llama are those of the open families fivefold imports (docs/model.md):
an explicit `head_dim` (Qwen3-32B: 64 heads of 128 on a 5120-wide model), biases on the attention projections (Qwen2),
query/key RMSNorm per head (Qwen3) or over the whole projection (OLMo 2), norms after the
attention and MLP instead of before (OLMo 2), RoPE scaling `linear`, `llama3` (Llama 3.1/3.2)
and `yarn` (Peng et al. 2023), and sliding-window attention (Mistral).

Mixture-of-experts (model/moe.py): with `n_experts` > 0 the MLP of the chosen layers (every
`moe_layer_freq`-th, after the first `moe_first_dense`) is a routed block of that many SwiGLU
experts of width `moe_ffn_dim`, top-`moe_top_k` routing, optional shared experts, and the
balancing losses and capacity of docs/moe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.errors import ConfigError


CHOICES = {
    "attention_bias": ("none", "qkv", "all"),
    "qk_norm": ("none", "head", "projection"),
    "norm_position": ("pre", "post"),
    "rope_scaling": ("none", "linear", "llama3", "yarn"),
    "moe_score": ("softmax", "sigmoid"),
    "moe_aux_loss": ("none", "switch", "sequence"),
    "moe_drop_policy": ("probability", "position"),
    "attention": ("mha", "mla"),
}


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
    head_dim: int = 0
    """Width of one attention head; 0 means dim / n_heads (Qwen3 sets it explicitly)."""
    attention_bias: str = "none"
    """Biases of the attention projections: `none` (Llama), `qkv` (Qwen2: query, key and value), `all` (also the output)."""
    mlp_bias: bool = False
    """Biases on the three SwiGLU projections."""
    qk_norm: str = "none"
    """RMSNorm of queries and keys before RoPE: `none`, `head` (Qwen3: per head, one gain of head_dim shared by all heads), `projection` (OLMo 2: over the whole query / key projection)."""
    norm_position: str = "pre"
    """Where the block norms sit: `pre` (Llama: x + f(norm(x))) or `post` (OLMo 2: x + norm(f(x)))."""
    rope_scaling: str = "none"
    """RoPE frequency scaling: `none`, `linear` (positions / rope_factor), `llama3` (Llama 3.1/3.2), `yarn` (Peng et al. 2023)."""
    rope_factor: float = 1.0
    """Context extension factor of rope_scaling (8 for Llama 3.1, 32 for Llama 3.2)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_context / low_freq_factor are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_context / high_freq_factor are kept; between, interpolated."""
    rope_original_max_seq_len: int = 0
    """Context the model was pre-trained with, before scaling (llama3 and yarn; 8192 for Llama 3.1)."""
    rope_beta_fast: float = 32.0
    """yarn: rotations at which the ramp from extrapolation starts."""
    rope_beta_slow: float = 1.0
    """yarn: rotations at which the ramp to interpolation ends."""
    rope_attention_factor: float = 0.0
    """yarn: scale of cos/sin (attention temperature); 0 means 0.1 * ln(rope_factor) + 1."""
    rope_mscale_all_dim: float = 0.0
    """yarn with MLA (DeepSeek-V2/V3): the softmax scale is multiplied by (0.1 x this x ln(rope_factor) + 1)^2; 0 is off."""
    sliding_window: int = 0
    """Each query attends to at most this many positions (itself included); 0 means full causal attention (Mistral v0.1: 4096)."""
    attention: str = "mha"
    """`mha`: multi-head attention with grouped-query heads (n_kv_heads); `mla`: DeepSeek-V2/V3 multi-latent attention (low-rank compressed keys and values, decoupled RoPE; model/mla.py)."""
    q_lora_rank: int = 0
    """MLA: rank of the query compression (0: queries projected directly, as DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """MLA: rank of the compressed key/value latent, the part cached at inference."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key width without RoPE."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query width with RoPE, and the one RoPE key shared by all heads."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    n_experts: int = 0
    """Routed experts E of each mixture-of-experts layer; 0 is a dense model (docs/moe.md)."""
    moe_top_k: int = 2
    """Experts each token is sent to."""
    moe_ffn_dim: int = 0
    """SwiGLU hidden size of one expert; 0 means ffn_hidden_dim."""
    moe_shared_experts: int = 0
    """Shared experts every token passes through (DeepSeek, Qwen-MoE), held as one SwiGLU of width moe_shared_experts x moe_ffn_dim."""
    moe_shared_ffn_dim: int = 0
    """Width of the shared-expert SwiGLU; 0 means moe_shared_experts x moe_ffn_dim (Qwen2-MoE sets its own)."""
    moe_shared_gate: bool = False
    """Qwen2-MoE: the shared experts' output is scaled by sigmoid(x . w) of a learned vector w."""
    moe_layer_freq: int = 1
    """Layer i (0-based) is a MoE layer when (i + 1) is a multiple of this and i >= moe_first_dense."""
    moe_first_dense: int = 0
    """The first this many layers keep a dense MLP (DeepSeek-V3: 3)."""
    moe_score: str = "softmax"
    """Router scores: `softmax` over the experts (Mixtral, Qwen) or `sigmoid` per expert (DeepSeek-V3)."""
    moe_norm_topk: bool = True
    """Renormalise the chosen top-k scores to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3; Qwen2-MoE: false)."""
    moe_route_scale: float = 1.0
    """Factor on the routed experts' weights (DeepSeek-V3's routed_scaling_factor 2.5)."""
    moe_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups, and a token chooses only among the moe_topk_groups groups whose two best selection scores sum highest; 1 is off."""
    moe_topk_groups: int = 1
    """Group-limited routing: groups a token may choose from (DeepSeek-V3's topk_group)."""
    moe_aux_loss: str = "none"
    """Load-balancing loss: `switch` (Fedus et al. 2021, over each micro-batch), `sequence` (DeepSeek-V3's sequence-wise loss)."""
    moe_aux_coeff: float = 0.01
    """Weight of the load-balancing loss."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss, mean of logsumexp(logits)^2 (Zoph et al. 2022); 0 is off."""
    moe_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the selection scores, moved by this much per step towards even load; 0 is off."""
    moe_capacity_factor: float = 0.0
    """Tokens an expert takes per sequence: ceil(factor x seq x top_k / E), the rest dropped; 0 is dropless."""
    moe_drop_policy: str = "probability"
    """Which tokens over capacity are dropped: the lowest-scored (`probability`) or the latest in the sequence (`position`)."""
    init_from_hf: str = ""
    """A local Hugging Face model folder: shape, weights and tokenizer are taken from it (`fivefold train --init-from-hf`)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """The head width in use: head_dim, or dim / n_heads."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and of the attention output): n_heads * head_size."""
        return self.n_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier != 1.0:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates: the head (MHA), or MLA's decoupled RoPE part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_hidden_dim

    @property
    def shared_hidden_dim(self) -> int:
        return self.moe_shared_ffn_dim or self.moe_shared_experts * self.expert_hidden_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` holds a mixture-of-experts MLP."""
        return self.n_experts > 0 and layer >= self.moe_first_dense and (layer + 1) % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} = {getattr(self, name)}: must be a positive integer")
        for name in ("n_kv_heads", "vocab_size", "ffn_dim", "head_dim", "sliding_window", "rope_original_max_seq_len",
                     "n_experts", "moe_ffn_dim", "moe_shared_experts", "moe_shared_ffn_dim", "moe_first_dense"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} = {getattr(self, name)}: must be >= 0 (0 means automatic)")
        if not self.head_dim and self.dim % self.n_heads:
            raise ConfigError(f"model.dim = {self.dim} is not divisible by model.n_heads = {self.n_heads}: "
                              "set model.head_dim explicitly, or change dim or n_heads")
        if self.head_size % 2:
            raise ConfigError(f"head dim {self.head_size} (model.head_dim, or model.dim / model.n_heads) must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads = {self.n_heads} is not a multiple of model.n_kv_heads = {self.kv_heads}: "
                "each key/value head must serve a whole group of query heads"
            )
        for name in ("norm_eps", "rope_theta", "init_std", "ffn_dim_multiplier", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"model.{name} = {value}: must be a positive finite number")
        if not (math.isfinite(self.rope_attention_factor) and self.rope_attention_factor >= 0):
            raise ConfigError(f"model.rope_attention_factor = {self.rope_attention_factor}: must be >= 0 (0 means automatic)")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name} = {getattr(self, name)!r}: one of {', '.join(allowed)}")
        if self.rope_scaling in ("llama3", "yarn") and not self.rope_original_max_seq_len:
            raise ConfigError(f"model.rope_scaling = {self.rope_scaling} needs model.rope_original_max_seq_len "
                              "(the pre-training context, e.g. 8192 for Llama 3.1)")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor = {self.rope_high_freq_factor} must exceed "
                              f"model.rope_low_freq_factor = {self.rope_low_freq_factor}")
        self._validate_moe()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} = {getattr(self, name)}: must be a positive integer")
        if self.q_lora_rank < 0:
            raise ConfigError(f"model.q_lora_rank = {self.q_lora_rank}: must be >= 0 (0: no query compression)")
        if self.attention == "mla":
            if self.qk_rope_head_dim % 2:
                raise ConfigError(f"model.qk_rope_head_dim = {self.qk_rope_head_dim} must be even for RoPE")
            unsupported = [n for n, v in (("attention_bias", self.attention_bias != "none"), ("qk_norm", self.qk_norm != "none"),
                                          ("sliding_window", self.sliding_window), ("norm_position", self.norm_position != "pre"))
                           if v]
            if unsupported:
                raise ConfigError(f"model.{unsupported[0]} is not available with model.attention = mla: leave it at its default")
        if not (math.isfinite(self.rope_mscale_all_dim) and self.rope_mscale_all_dim >= 0):
            raise ConfigError(f"model.rope_mscale_all_dim = {self.rope_mscale_all_dim}: must be a finite number >= 0")
        if self.rope_mscale_all_dim and (self.attention != "mla" or self.rope_scaling != "yarn"):
            raise ConfigError("model.rope_mscale_all_dim scales multi-latent attention under yarn RoPE scaling (DeepSeek): "
                              "set model.attention = mla and model.rope_scaling = yarn, or leave it at 0")

    def _validate_moe(self) -> None:
        for name in ("moe_top_k", "moe_layer_freq", "moe_groups", "moe_topk_groups"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} = {getattr(self, name)}: must be a positive integer")
        if self.n_experts == 0:
            return
        if self.moe_top_k > self.n_experts:
            raise ConfigError(f"model.moe_top_k = {self.moe_top_k}: must lie in 1 .. model.n_experts = {self.n_experts}")
        if not self.moe_layers:
            raise ConfigError(f"model.n_experts = {self.n_experts} but no layer is a MoE layer (moe_first_dense = "
                              f"{self.moe_first_dense}, moe_layer_freq = {self.moe_layer_freq}, n_layers = {self.n_layers}): "
                              "lower moe_first_dense or moe_layer_freq")
        for name in ("moe_aux_coeff", "moe_z_loss_coeff", "moe_bias_update_rate", "moe_capacity_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"model.{name} = {value}: must be a finite number >= 0")
        if not (math.isfinite(self.moe_route_scale) and self.moe_route_scale > 0):
            raise ConfigError(f"model.moe_route_scale = {self.moe_route_scale}: must be a positive finite number")
        if self.moe_shared_gate and not self.shared_hidden_dim:
            raise ConfigError("model.moe_shared_gate gates the shared experts: set model.moe_shared_experts (or moe_shared_ffn_dim)")
        self._validate_groups()

    def _validate_groups(self) -> None:
        groups, top = self.moe_groups, self.moe_topk_groups
        if groups == 1:
            if top != 1:
                raise ConfigError(f"model.moe_topk_groups = {top} needs group-limited routing: set model.moe_groups > 1")
            return
        if self.n_experts % groups or self.n_experts // groups < 2:
            raise ConfigError(f"model.moe_groups = {groups} must split model.n_experts = {self.n_experts} into equal groups "
                              "of at least 2 experts (a group is ranked by its two best scores)")
        if top > groups or self.moe_top_k > top * (self.n_experts // groups):
            raise ConfigError(f"model.moe_topk_groups = {top}: must lie in 1 .. moe_groups = {groups} and offer at least "
                              f"moe_top_k = {self.moe_top_k} experts ({self.n_experts // groups} per group)")
