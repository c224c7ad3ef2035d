"""The matmuls of one block's forward (and of the head) on one rank, each with its shape: what the compute
model's width law prices (plan/efficiency.py `Efficiency.share`) by the narrower side of the weight slice.

A GEMM (M x K) @ (K x N) runs further from peak the narrower its weight slice is: a short K loop whose start
and end are not hidden, few column tiles to spread over the streaming multiprocessors, less reuse of each
operand. Under tensor parallelism the per-rank N (column-parallel) or K (row-parallel) is the width over tp,
so the same model runs its matmuls less efficiently at tp 8 than at tp 1, while a wide model (h = 25,600)
keeps them wide. The attention core multiplies by the head dimension, the narrowest of all. The token
dimension M (micro-batch x sequence, 2,048 and more in training) is not part of the law: a wide weight
slice keeps every tile busy over 2,048 rows (the published 1T rows, docs/simulator.md, show it; with
min(M, K, N) they were predicted 7-17% slow). GEMMs whose M is short (a routed expert's few rows, decoding)
are bound by reading their weights, which the law does not model.

Each GEMM's FLOPs follow the planner's convention (plan/estimate.py `_block_forward_flops`: 2 x the block's
matmul parameters per token over tp and cp); what the named GEMMs leave over (biases, norms, MLA's low-rank
norms) is one more entry at the block's width, so the entries sum to that count exactly (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model package imports torch; `fivefold --help` must not
    from fivefold.model.config import ModelConfig


@dataclass(frozen=True)
class Gemm:
    name: str
    flops: float  # forward, on one rank, for one micro-batch
    m: float  # rows (tokens) x K (contracted) @ K x N, as one rank runs it
    k: float
    n: float
    routed: bool = False  # a routed expert's (the part of a MoE block that grows with the rows it receives)

    @property
    def narrowest(self) -> float:
        """The narrower side of the weight slice the rank multiplies by: min(K, N)."""
        return min(self.k, self.n)


def block_gemms(model: ModelConfig, layer: int, tokens: int, tp: int, cp: int, sp: bool, etp: int = 1) -> list[Gemm]:
    """The matmuls of block `layer` on one rank for `tokens` tokens (before the cp split), without the attention
    core (a routed expert's M: the rank's own tokens, its rows before dispatch)."""
    from fivefold.plan.parameters import block_parameters

    h, m = model.dim, tokens / cp
    inside = 2 * tokens / (tp * cp)  # FLOPs per full-width parameter, inside the tensor-parallel region
    gemms = _attention_gemms(model, m, tp, inside)
    if model.is_moe_layer(layer):
        outside = 2 * tokens / (cp * (tp if sp else 1))  # the MoE layer runs outside it
        rows = tokens / (cp * (tp if sp else 1))
        gemms.append(Gemm("router", outside * h * model.n_experts, rows, h, model.n_experts))
        if model.shared_hidden_dim:
            gemms.append(Gemm("shared", outside * 3 * h * model.shared_hidden_dim, rows, h, model.shared_hidden_dim))
        if model.moe_shared_gate:
            gemms.append(Gemm("shared gate", outside * h, rows, h, 1))
        routed = block_parameters(model, layer).experts * model.moe_top_k // model.n_experts
        gemms.append(Gemm("experts", outside * routed, rows, h, _expert_width(model, etp), routed=True))
    else:
        f = model.ffn_hidden_dim
        gemms += [Gemm("w1 w3", inside * 2 * h * f, m, h, max(f // tp, 1)),
                  Gemm("w2", inside * h * f, m, max(f // tp, 1), h)]
    full = block_parameters(model, layer)
    matmul = full.dense - 2 * h  # the two norms' weights are not matmuls (as _block_forward_flops counts)
    if model.is_moe_layer(layer):
        matmul -= h * model.n_experts + 3 * h * model.shared_hidden_dim + (h if model.moe_shared_gate else 0)
    named = sum(g.flops for g in gemms if g.name not in ("router", "shared", "shared gate", "experts"))
    rest = inside * matmul - named
    if rest > 0:
        gemms.append(Gemm("other", rest, m, h, h))
    return gemms


def _attention_gemms(model: ModelConfig, m: float, tp: int, inside: float) -> list[Gemm]:
    h = model.dim
    if model.attention == "mla":
        heads, qk = max(model.n_heads // tp, 1), model.qk_nope_head_dim + model.qk_rope_head_dim
        out = []
        if model.q_lora_rank:
            out += [Gemm("wq_a", inside * h * model.q_lora_rank, m, h, model.q_lora_rank),
                    Gemm("wq_b", inside * model.q_lora_rank * model.n_heads * qk, m, model.q_lora_rank, heads * qk)]
        else:
            out.append(Gemm("wq", inside * h * model.n_heads * qk, m, h, heads * qk))
        kv_a = model.kv_lora_rank + model.qk_rope_head_dim
        out += [Gemm("wkv_a", inside * h * kv_a, m, h, kv_a),
                Gemm("wkv_b", inside * model.kv_lora_rank * model.n_heads * (model.qk_nope_head_dim + model.v_head_dim),
                     m, model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim)),
                Gemm("wo", inside * model.n_heads * model.v_head_dim * h, m, heads * model.v_head_dim, h)]
        return out
    d = model.head_size
    q, kv = model.q_dim, model.kv_heads * d
    return [Gemm("wq", inside * h * q, m, h, q // tp),
            Gemm("wkv", inside * 2 * h * kv, m, h, max(model.kv_heads // tp, 1) * d),
            Gemm("wo", inside * q * h, m, q // tp, h)]


def core_narrowest(model: ModelConfig) -> int:
    """The attention core's narrowest dimension: the head dimension q k^T contracts over and p v produces
    (MLA: the one width the core pads q, k and v to)."""
    if model.attention == "mla":
        return max(model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim)
    return model.head_size


def _expert_width(model: ModelConfig, etp: int) -> int:
    """A routed expert's hidden width on one expert-tensor-parallel rank."""
    return max(model.expert_hidden_dim // etp, 1)


def routed_narrowest(model: ModelConfig, etp: int = 1) -> int:
    """A routed expert GEMM's narrowest weight side on a rank (`block_gemms`' "experts"): min(dim, hidden / etp)."""
    return min(model.dim, _expert_width(model, etp))


def head_gemm(model: ModelConfig, tokens: int, tp: int, cp: int) -> Gemm:
    """The output head's matmul on the last stage: tokens x dim @ dim x (padded vocabulary / tp)."""
    from fivefold.plan.parameters import padded_vocab

    vocab = padded_vocab(model.vocab_size, tp)
    return Gemm("head", 2 * vocab * model.dim * tokens / (tp * cp), tokens / cp, model.dim, vocab // tp)

