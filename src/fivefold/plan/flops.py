"""Exact parameter counts and training FLOPs of the Llama-style decoder.

Parameters are counted tensor by tensor (GQA key/value projections, SwiGLU's three
matrices, RMSNorm weights, untied or tied head), so the count equals the instantiated model's.

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

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head

    @property
    def matmul(self) -> int:
        """Parameters that take part in matrix multiplies (the head, even when tied)."""
        return self.attention + self.mlp + (self.head or self.embedding)


def count_parameters(config: ModelConfig) -> ParameterCount:
    h, layers, hd = config.dim, config.n_layers, config.head_size
    q_and_o = 2 * h * config.n_heads * hd
    k_and_v = 2 * h * config.kv_heads * hd
    return ParameterCount(
        embedding=config.vocab_size * h,
        attention=layers * (q_and_o + k_and_v),
        mlp=layers * 3 * h * config.ffn_hidden_dim,
        norms=(2 * layers + 1) * h,
        head=0 if config.tie_embeddings else config.vocab_size * h,
    )


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """12 * L * H * Q * T: QK^T and AV, forward and backward (PaLM appendix B)."""
    return 12 * config.n_layers * config.n_heads * config.head_size * seq_len


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 N_matmul + 12 L H Q T."""
    return 6 * count_parameters(config).matmul + attention_flops_per_token(config, seq_len)


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """A third of the training count: the forward pass alone."""
    return flops_per_token(config, seq_len) // 3
