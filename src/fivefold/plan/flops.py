"""Exact parameter counts and training FLOPs of the Llama-style decoder.

Parameters are counted tensor by tensor (GQA key/value projections with the head width in
use, SwiGLU's three matrices, RMSNorm gains including query/key norms, biases, untied or tied
head), so the count equals the instantiated model's.

FLOPs per token for training follow PaLM (Chowdhery et al. 2022, appendix B):
    6 * N_matmul + 12 * L * H * Q * T
where N_matmul are the parameters used in matrix multiplies (every weight except the input
embedding lookup and the norm gains; a tied head counts once, as the head), and the second
term is attention's QK^T and AV products, fwd + bwd, with H heads of size Q over context T.
Causal masking is not subtracted, as in PaLM and in PyTorch's FLOP counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.model.config import ModelConfig


@dataclass(frozen=True)
class ParameterCount:
    embedding: int
    attention: int
    mlp: int
    norms: int
    head: int
    biases: int = 0

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head + self.biases

    @property
    def matmul(self) -> int:
        """Parameters that take part in matrix multiplies (the head, even when tied; not biases)."""
        return self.attention + self.mlp + (self.head or self.embedding)


def count_parameters(config: ModelConfig) -> ParameterCount:
    h, layers, f = config.dim, config.n_layers, config.ffn_hidden_dim
    q, kv = config.q_dim, config.kv_dim
    qk_norms = {"none": 0, "head": 2 * config.head_size, "projection": q + kv}[config.qk_norm]
    attention_biases = {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + h}[config.attention_bias]
    mlp_biases = 2 * f + h if config.mlp_bias else 0
    return ParameterCount(
        embedding=config.vocab_size * h,
        attention=layers * (2 * h * q + 2 * h * kv),
        mlp=layers * 3 * h * f,
        norms=(2 * layers + 1) * h + layers * qk_norms,
        head=0 if config.tie_embeddings else config.vocab_size * h,
        biases=layers * (attention_biases + mlp_biases),
    )


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """12 * L * H * Q * T: QK^T and AV, forward and backward (PaLM appendix B)."""
    return 12 * config.n_layers * config.q_dim * seq_len


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 N_matmul + 12 L H Q T."""
    return 6 * count_parameters(config).matmul + attention_flops_per_token(config, seq_len)


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """A third of the training count: the forward pass alone."""
    return flops_per_token(config, seq_len) // 3
