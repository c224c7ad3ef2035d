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

Mixture-of-experts layers count all E experts, the shared experts and the router in the total, and
only the top-k experts (plus shared experts and router) in what one token multiplies by, so FLOPs
per token use the active count (the "activated parameters" of Mixtral's and DeepSeek's reports).
Dropped assignments (capacity) are not subtracted.
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
    mlp_active: int = -1  # MLP parameters one token uses (MoE: top-k experts, shared experts, router); -1: all
    routed_experts: int = 0  # of mlp: the routed experts' weights (what expert parallelism splits)

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head + self.biases

    @property
    def active(self) -> int:
        """Parameters one token uses (a mixture-of-experts model's "activated" count; the total when dense)."""
        return self.total - self.mlp + self.mlp_used

    @property
    def mlp_used(self) -> int:
        return self.mlp if self.mlp_active < 0 else self.mlp_active

    @property
    def matmul(self) -> int:
        """Parameters one token multiplies by (the head, even when tied; not biases; MoE: the active experts)."""
        return self.attention + self.mlp_used + (self.head or self.embedding)


def count_parameters(config: ModelConfig) -> ParameterCount:
    h, layers, f = config.dim, config.n_layers, config.ffn_hidden_dim
    q, kv = config.q_dim, config.kv_dim
    qk_norms = {"none": 0, "head": 2 * config.head_size, "projection": q + kv}[config.qk_norm]
    attention_biases = {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + h}[config.attention_bias]
    mlp_biases = 2 * f + h if config.mlp_bias else 0
    moe = len(config.moe_layers)
    dense = layers - moe
    expert = 3 * h * config.expert_hidden_dim
    shared = 3 * h * config.shared_hidden_dim + (h if config.moe_shared_gate else 0)
    router = h * config.n_experts
    mlp = dense * 3 * h * f + moe * (config.n_experts * expert + shared + router)
    mlp_active = dense * 3 * h * f + moe * (config.moe_top_k * expert + shared + router)
    attention = 2 * h * q + 2 * h * kv
    mla_norms = 0
    if config.attention == "mla":  # model/mla.py
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        heads, rank = config.n_heads, config.kv_lora_rank
        query = (h * config.q_lora_rank + config.q_lora_rank * heads * qk) if config.q_lora_rank else h * heads * qk
        attention = (query + h * (rank + config.qk_rope_head_dim) + rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
                     + heads * config.v_head_dim * h)
        mla_norms = rank + config.q_lora_rank
    return ParameterCount(
        embedding=config.vocab_size * h,
        attention=layers * attention,
        mlp=mlp,
        mlp_active=mlp_active if moe else -1,
        routed_experts=moe * config.n_experts * expert,
        norms=(2 * layers + 1) * h + layers * (qk_norms + mla_norms),
        head=0 if config.tie_embeddings else config.vocab_size * h,
        biases=layers * attention_biases + dense * mlp_biases,
    )


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """12 * L * H * Q * T: QK^T and AV, forward and backward (PaLM appendix B); with MLA the QK^T width is
    heads x (nope + rope) and the AV width heads x v_head_dim: 6 * L * T * (H*(n+r) + H*v)."""
    if config.attention == "mla":
        widths = config.n_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
        return 6 * config.n_layers * widths * seq_len
    return 12 * config.n_layers * config.q_dim * seq_len


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 N_matmul + 12 L H Q T."""
    return 6 * count_parameters(config).matmul + attention_flops_per_token(config, seq_len)


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """A third of the training count: the forward pass alone."""
    return flops_per_token(config, seq_len) // 3
