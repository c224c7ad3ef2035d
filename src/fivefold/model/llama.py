"""Llama-style decoder in plain PyTorch (Touvron et al. 2023; Dubey et al. 2024).

Pre-norm blocks: h = x + Attn(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h)); or, with
norm_position = "post" (OLMo 2, Groeneveld et al. 2024 / OLMo 2 2025), h = x + RMSNorm(Attn(x)).
Attention uses rotary position embeddings (Su et al. 2021) in the half-split ("rotate_half")
convention of GPT-NeoX and Hugging Face, with optional frequency scaling (linear position
interpolation, Chen et al. 2023; Llama 3.1's `llama3`; YaRN, Peng et al. 2023), grouped-query
attention (Ainslie et al. 2023) with `n_kv_heads` covering MHA, GQA and MQA, optional biases
(Qwen2), query/key RMSNorm (Qwen3 per head, OLMo 2 over the projection; Dehghani et al. 2023),
an optional sliding window (Mistral; Beltagy et al. 2020), and `scaled_dot_product_attention`
for the core. Blocks chosen by the config hold a mixture-of-experts MLP (model/moe.py); with
attention = mla the attention is DeepSeek's multi-latent attention (model/mla.py).

The model is built on the meta device and materialised with `materialize`, so that later
parallel code can place or shard weights before any memory is spent. Each weight is drawn
from a generator seeded by (seed, parameter name), so a rank that holds only part of the
model draws exactly the values the whole model would have.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.config import ModelConfig
from fivefold.model.layers import FeedForward, RMSNorm, apply_rope, attention_mask  # noqa: F401 - re-exported
from fivefold.model.mla import MultiLatentAttention, cache_values_per_token
from fivefold.model.moe import MoE
from fivefold.errors import ConfigError

# Residual-branch output projections get the GPT-2 / GPT-NeoX depth-scaled init.
# (Every SwiGLU's w2: the dense MLP's, each expert's and the shared experts'.)
_RESIDUAL_OUTPUTS = ("attention.wo.weight", ".w2.weight")


def rope_frequencies(config: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_size / 2,) after the configured scaling, and the cos/sin scale.

    The formulas (and their float32 arithmetic) follow the reference implementations, so that
    imported models see the very same angles: `linear` divides every frequency by the factor;
    `llama3` divides only the low frequencies (wavelength > original / low_freq_factor), keeps the
    high ones (< original / high_freq_factor) and interpolates between; `yarn` blends interpolated
    and extrapolated frequencies along a ramp between the dimensions that turn beta_fast and
    beta_slow times over the original context, and scales cos/sin by the attention factor.
    """
    dim, base, factor = config.rope_dim, config.rope_theta, config.rope_factor
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    kind = config.rope_scaling
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        original = config.rope_original_max_seq_len
        low_wavelen = original / config.rope_low_freq_factor
        high_wavelen = original / config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - config.rope_low_freq_factor) / (config.rope_high_freq_factor - config.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        original = config.rope_original_max_seq_len
        attention_factor = config.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(config.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(config.rope_beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
        position_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
        extrapolation = 1 - ramp
        blended = (1.0 / (factor * position_freqs)) * (1 - extrapolation) + (1.0 / position_freqs) * extrapolation
        return blended, attention_factor
    return inv_freq, 1.0


def rope_tables(config: ModelConfig, device: torch.device | None = None):
    """cos/sin tables of shape (max_seq_len, rope_dim) for the half-split RoPE convention."""
    inv_freq, scale = rope_frequencies(config, device)
    positions = torch.arange(config.max_seq_len, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


class KVCache:
    """Preallocated keys and values of every layer, for incremental decoding."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device, dtype: torch.dtype):
        shape = (batch_size, config.kv_heads, max_len, config.head_size)
        value_shape = shape
        if config.attention == "mla":  # the latent and the RoPE key (model/mla.py); no values
            shape = (batch_size, 1, max_len, cache_values_per_token(config))
            value_shape = (batch_size, 1, max_len, 0)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(value_shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.lengths = [0] * config.n_layers
        self.max_len = max_len

    @property
    def seq_len(self) -> int:
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (all layers, the whole preallocated length)."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        if end > self.max_len:
            raise ConfigError(f"the KV cache holds model.max_seq_len = {self.max_len} positions; generation asked for {end}: "
                              "generate fewer tokens or use a shorter prompt")
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0, window: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal (and window) mask) v, on (batch, heads, seq, head_dim) tensors."""
    # Query head j reads key/value head j // (n_heads / n_kv_heads), without materialising copies.
    gqa = q.shape[1] != k.shape[1]
    mask = attention_mask(q.shape[2], past, window, q.device)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_size
        self.sliding_window = config.sliding_window
        qkv_bias = config.attention_bias in ("qkv", "all")
        self.wq = nn.Linear(config.dim, config.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(config.dim, config.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(config.dim, config.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(config.q_dim, config.dim, bias=config.attention_bias == "all")
        self.qk_norm = config.qk_norm
        self.q_norm = self.k_norm = None
        if config.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        elif config.qk_norm == "projection":
            self.q_norm = RMSNorm(config.q_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.kv_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        batch, seq = q.shape[:2]  # the sequence the projections produced (a tensor-parallel layer may gather it)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, -1, self.head_dim)
        k = k.view(batch, seq, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.lengths[self.layer_id]
            k, v = cache.update(self.layer_id, k, v)
        out = self.core(q, k, v, past, self.sliding_window)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0, window: int = 0) -> torch.Tensor:
        """The attention core (`attention_core`), a method of its own so that parallel code can
        replace or wrap it (selective recomputation, context parallelism) without touching the
        projections."""
        return attention_core(q, k, v, past, window)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = MultiLatentAttention(config, layer_id) if config.attention == "mla" else Attention(config, layer_id)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if config.is_moe_layer(layer_id):
            self.feed_forward = MoE(config, layer_id)
        else:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim, config.mlp_bias)
        self.post_norm = config.norm_position == "post"

    def forward(self, x, cos, sin, cache: KVCache | None = None):
        if self.post_norm:  # OLMo 2: the norms act on each branch's output
            h = x + self.attention_norm(self.attention(x, cos, sin, cache))
            return h + self.ffn_norm(self.feed_forward(h))
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size < 1:
            raise ConfigError("model.vocab_size must be set (0 means: take it from the tokenizer first)")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        # A dict keyed by layer index keeps parameter names stable when layers are removed (pipeline stages).
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config, device=torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, tokens: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """Logits, or with project=False the normalised hidden states the output projection would read
        (a loss that applies the projection itself, ops/linear_cross_entropy.py)."""
        seq = tokens.shape[1]
        if positions is None:
            start = cache.seq_len if cache is not None else 0
            positions = torch.arange(start, start + seq, device=tokens.device)
        cos, sin = self.rope(positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache)
        return self.head(h) if project else self.norm(h)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the rotary angles at these (global) positions."""
        return self.rope_cos[positions], self.rope_sin[positions]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection (the embedding matrix when tied): hidden states -> logits."""
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output projection's (vocab, dim) matrix: the embedding table when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables on the device the model lives on; zero the experts' balancing biases."""
        cos, sin = rope_tables(self.config, self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin
        for module in self.modules():
            if isinstance(module, MoE):
                module.expert_bias.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, init_std) for matrices, depth-scaled for residual outputs, ones for norms, zeros for biases.

        Each parameter's values depend only on (seed, its name), never on which other
        parameters exist or on the order they are visited.
        """
        std = self.config.init_std
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name.endswith(".bias"):
                param.zero_()
                continue
            scale = std / math.sqrt(2 * self.config.n_layers) if name.endswith(_RESIDUAL_OUTPUTS) else std
            generator = torch.Generator().manual_seed(parameter_seed(seed, name))
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).mul_(scale))
        self.init_buffers()


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run seed and a parameter's fully qualified name."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def build_model(config: ModelConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(config)


def materialize(model: Transformer, device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """Allocate a meta model's storage on `device`; initialise it unless seed is None (weights come later)."""
    model.to_empty(device=device)
    if seed is None:
        model.init_buffers()
    else:
        model.init_weights(seed)
    return model
