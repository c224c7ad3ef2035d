"""Llama-style decoder in plain PyTorch (Touvron et al. 2023; Dubey et al. 2024).

Pre-norm blocks: h = x + Attn(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h)).
Attention uses rotary position embeddings (Su et al. 2021) in the half-split ("rotate_half")
convention of GPT-NeoX and Hugging Face, grouped-query attention (Ainslie et al. 2023) with
`n_kv_heads` covering MHA, GQA and MQA, and `scaled_dot_product_attention` for the core.

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
from fivefold.errors import ConfigError

# Residual-branch output projections get the GPT-2 / GPT-NeoX depth-scaled init.
_RESIDUAL_OUTPUTS = ("attention.wo.weight", "feed_forward.w2.weight")


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 like the reference Llama."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None):
    """cos/sin tables of shape (max_seq_len, head_dim) for the half-split RoPE convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, heads, seq, head_dim) by the angles of its positions."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class KVCache:
    """Preallocated keys and values of every layer, for incremental decoding."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device, dtype: torch.dtype):
        shape = (batch_size, config.kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.lengths = [0] * config.n_layers
        self.max_len = max_len

    @property
    def seq_len(self) -> int:
        return self.lengths[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        if end > self.max_len:
            raise ConfigError(f"the KV cache holds model.max_seq_len = {self.max_len} positions; generation asked for {end}: "
                              "generate fewer tokens or use a shorter prompt")
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.lengths[self.layer_id]
            k, v = cache.update(self.layer_id, k, v)
        out = self.core(q, k, v, past)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v, on (batch, heads, seq, head_dim) tensors.

        The attention core is a method of its own so that parallel code can replace or wrap it
        (selective recomputation, context parallelism) without touching the projections.
        """
        seq = q.shape[2]
        # Query head j reads key/value head j // (n_heads / n_kv_heads), without materialising copies.
        gqa = q.shape[1] != k.shape[1]
        if past == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, enable_gqa=gqa)
        # Query i (absolute position past + i) sees keys 0 .. past + i.
        mask = torch.ones(seq, past + seq, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer_id)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x, cos, sin, cache: KVCache | None = None):
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
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta, device=torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, tokens: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq = tokens.shape[1]
        if positions is None:
            start = cache.seq_len if cache is not None else 0
            positions = torch.arange(start, start + seq, device=tokens.device)
        cos, sin = self.rope(positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, cache)
        return self.head(h)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the rotary angles at these (global) positions."""
        return self.rope_cos[positions], self.rope_sin[positions]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection (the embedding matrix when tied): hidden states -> logits."""
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables on the device the model lives on."""
        cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta, self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, init_std) for matrices, depth-scaled for residual outputs, ones for norms.

        Each parameter's values depend only on (seed, its name), never on which other
        parameters exist or on the order they are visited.
        """
        std = self.config.init_std
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
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
