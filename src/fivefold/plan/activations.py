"""Activation memory per transformer block: what autograd keeps for backward, derived for our block.

Korthikanti et al. (2022) count, per layer of a GPT block (16-bit, dropout, GELU MLP of 4h),
s*b*h*(34 + 5*a*s/h) bytes; with tensor parallelism t: s*b*h*(10 + 24/t + 5*a*s/(h*t)); with
sequence parallelism too: s*b*h/t*(34 + 5*a*s/h). Our block differs (SwiGLU of width f, RMSNorm
computed in fp32, no dropout, GQA with n_kv heads of size d (h/a unless head_dim is set; q = a*d
is the query width), RoPE, fused SDPA attention that keeps the log-sum-exp instead of the s x s
score matrix), so we derive its count the same way, tensor by tensor, in *elements* (times 4
bytes in fp32):

    attention norm   input x, 1/rms (s*b), normalised x          2sbh + sb
    q, k, v input    the norm output (shared by the three)        sbh
    RoPE             cos, sin tables of the positions             2sd
    SDPA             q, k, v, output, log-sum-exp                 2sbq + 2sb*n_kv*d + a*s*b
                     (the output is also wo's input: one tensor)
    MLP norm         input, 1/rms, normalised, output             3sbh + sb
    SwiGLU           w1 x, silu(w1 x), w3 x, their product        4sbf

    none:       6sbh + 2sbq + 4sbf + 2sb*n_kv*d + 2sb + asb + 2sd
    TP t:       6sbh + 2sb + 2sd + (2sbq + 4sbf + asb)/t + 2sb*kv_t*d     (kv_t = max(n_kv/t, 1))
                (norms and their outputs replicated; q, output, lse and the MLP split by t)
    TP + SP:    2sbh + 2sd + (4sbh + 2sbq + 2sb + 4sbf + asb)/t + 2sb*kv_t*d
                (norms on s/t of the sequence; the all-gathered inputs of q/k/v and w1/w3, 2sbh,
                are kept whole: Megatron-LM keeps them sharded and gathers again in backward)
    selective:  none - asb (the core is recomputed; q, k, v are its saved inputs, and its
                output is still kept by wo, so with fused attention only the lse goes)
    full:       sbh + 2sd (the block's input and the RoPE tables; everything else is recomputed)
    Ulysses     with context parallelism's heads split over n ranks (method ulysses or 2d), none also
                keeps the core's own head-layout output, sbq/t, and k, v repeated r times to split
                the rank's kv heads over n, 2sb*kv_t*d*(r - 1) (`head_parallel_elements`)

    q/k norms   `head` (Qwen3): 2sbq/t + 2sb*kv_t*d + sb(a/t + kv_t); `projection` (OLMo 2):
                2sbq/t + 2sb*kv_t*d + 2sb (fp32 input, 1/rms, normalised output; full recompute
                drops them with the rest)

Derived and measured for the plain Llama block, an explicit head_dim (q != h) and both q/k
norms; the other options of the open families (biases, post norms, a sliding window's explicit
mask) change what autograd keeps and are not counted yet.

Multi-latent attention (model/mla.py; n, r, v its nope, rope and value head widths, c the latent rank,
q' the query rank, W = max(n + r, v), a_t = a / t heads on the rank) keeps in place of q, k, v, output
and lse (`_mla_elements`):

    query path   q' > 0: the q norm's input, 1/rms, normalised, output           3sbq' + sb
    latent       W_kva's output sb(c + r), the norm's normalised and output 2sbc, 1/rms sb
    RoPE         cos, sin of width r                                           2sr
    core         q, k padded to W, values padded to W (or, when v = W, the view of W_kvb's output
                 sb a_t (n + v)), the kernel's output sb a_t W, lse a_t sb, wo's input sb a_t v
    selective    q, k (sb a_t (n + r) each), W_kvb's output sb a_t (n + v), wo's input sb a_t v

A mixture-of-experts block (model/moe.py) keeps, in place of the SwiGLU's 4sbf, for the T = sb
tokens of the rank, its A kept (token, choice) assignments (kT when dropless) and the R rows its
experts compute (A in one process; what the all-to-all brought with expert parallelism, after the
ETP all-gather with expert tensor parallelism), experts of width f_e / etp, E_l of them local:

    router       scores (sigmoid or softmax output) TE, chosen indices 2Tk (int64),
                 with moe_norm_topk the chosen scores and their sum Tk + T
    token side   token and assignment indices 2A + 2A, the assignment weights A, the returned
                 expert rows Ah (the combine keeps only them: model/moe.py `_Combine`)
    expert side  the rows' input Rh, SwiGLU 4R f_e/etp; with EP or ETP the regrouping index and
                 its inverse 4R; the grouped kernel also its stacked weights 3 E_l h f_e/etp and
                 offsets E_l (int32)
    shared       4T f_s, with the Qwen2-MoE gate T h + T
    losses       switch E, sequence bE (each + T with sigmoid scores), z-loss TE + T

(one process: the rows' input is the gathered tokens, so the regrouping indices are absent). Which
experts are chosen is computed without gradient, so the selection bias and group-limited routing
keep nothing (`moe_block_activation_elements`). Under tensor parallelism the layer runs outside the
region: on all s b tokens, or with sequence parallelism on the rank's s b / t, keeping the norm's local
output (s b h / t) where the SwiGLU kept its all-gathered input (s b h).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.model.config import ModelConfig


@dataclass(frozen=True)
class ActivationShape:
    micro_batch: int
    seq_len: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    head_parallel: int = 1  # context parallelism's Ulysses head group (ulysses: cp; 2d: context_parallel.heads)


def block_activation_elements(model: ModelConfig, shape: ActivationShape) -> int:
    """Elements one transformer block keeps for backward on one rank (see the module docstring)."""
    s, b, t = shape.seq_len, shape.micro_batch, shape.tp
    h, f, d = model.dim, model.ffn_hidden_dim, model.rope_dim
    sbh, sb = s * b * h, s * b
    if shape.recompute == "full":
        return (sbh // t if shape.sequence_parallel else sbh) + 2 * s * d
    if t == 1:
        total = 6 * sbh + 4 * sb * f + 2 * sb
    elif shape.sequence_parallel:
        total = 2 * sbh + (4 * sbh + 2 * sb + 4 * sb * f) // t
    else:
        total = 6 * sbh + 2 * sb + 4 * sb * f // t
    total += 2 * s * d  # the RoPE tables
    if model.attention == "mla":
        return total + _mla_elements(model, sb, t, shape.recompute)
    kv = max(model.kv_heads // t, 1)
    a, sbq = model.n_heads, sb * model.q_dim
    total += (2 * sbq + a * sb) // t + 2 * sb * kv * model.head_size
    if model.qk_norm != "none":
        total += _qk_norm_elements(model, sb, t, kv, model.head_size)
    if shape.recompute == "selective":
        total -= a * sb // t
    return total + head_parallel_elements(model, shape)


def head_parallel_elements(model: ModelConfig, shape: ActivationShape) -> int:
    """What a block keeps beyond the count above when context parallelism splits the heads over a group of n > 1
    ranks (Ulysses, or 2D's head groups: parallel/context_parallel.py). The core runs on the head layout, so it
    keeps its own output there while wo keeps the output all-to-all'd back (sb a_t d more), and when the rank's
    kv_t key/value heads are repeated r times to split over n (`_kv_repeats`) its k and v are r times their size
    (2 sb kv_t d (r - 1) more). Nothing under selective recomputation, whose region starts before the all-to-all
    (q, k, v are saved in the sequence layout, the output is only wo's), nor under full recomputation."""
    n = shape.head_parallel
    if n == 1 or shape.recompute != "none":
        return 0
    from fivefold.parallel.context_parallel import _kv_repeats

    sb, t, d = shape.seq_len * shape.micro_batch, shape.tp, model.head_size
    heads, kv = model.n_heads // t, max(model.kv_heads // t, 1)
    return sb * d * (heads + 2 * kv * (_kv_repeats(heads, kv, n) - 1))


def autocast_extra_elements(model: ModelConfig, shape: ActivationShape) -> int:
    """What a dense block keeps under bf16 autocast over fp32 weights (train.dtype = bf16) beyond 2 bytes per
    element of `block_activation_elements`, in 2-byte units (each storage once, measured on the CPU under
    autocast: tests/test_planner.py, tests/distributed/test_activation_memory.py).

    Tensors kept in fp32 count twice: RMSNorm's input, normalised output and 1/rms (4sbh + 2sb; on s/t tokens
    under sequence parallelism), the log-sum-exp (a/t sb, not under selective recomputation), the RoPE tables
    (2sd), and under full recomputation everything (the block's input is the fp32 residual stream). Each matmul
    casts its fp32 input to bf16 itself: q, k, v and w1, w3 keep 5 casts of sbh (whole, also the all-gathered ones
    under SP) where the fp32 count keeps 2 norm outputs (or 2 gathered inputs):

        none        7sbh + 2sb + a sb / t + 2sd
        SP          3sbh + (4sbh + 2sb + a sb) / t + 2sd
        selective   the same without the a sb term

    q/k norms add an fp32 copy of their inputs, sb (q/t + kv_t d), kept twice under selective recomputation
    (the recomputed core's inputs, q and k after the norm, are fp32), and their 1/rms in fp32: sb (a/t + kv_t)
    per head, 2sb per projection. Multi-latent attention casts the block input twice, not three times (- sbh),
    and its latent and query RMSNorms keep fp32 copies of their inputs: sb (c - r + 1), + sb (q_lora + 1) with
    query compression. A MoE block's: `moe_autocast_extra_elements`."""
    if shape.recompute == "full":
        return block_activation_elements(model, shape)
    s, b, t = shape.seq_len, shape.micro_batch, shape.tp
    sbh, sb, a = s * b * model.dim, s * b, model.n_heads
    lse = a * sb if shape.recompute == "none" else 0
    if shape.sequence_parallel:
        extra = 3 * sbh + (4 * sbh + 2 * sb + lse) // t
    else:
        extra = 7 * sbh + 2 * sb + lse // t
    extra += 2 * s * model.rope_dim
    if model.attention == "mla":  # model/mla.py: two casts of the block input (wq or wq_a, wkv_a) where q, k, v
        # made three; the latent's RMSNorm keeps an fp32 copy of its c columns (the fp32 count kept the c + r columns
        # of wkv_a's output it is a view of) and its 1/rms in fp32, the query's (q_lora_rank) likewise; the
        # down-projections and their norms run whole on every tensor-parallel rank
        extra += -sbh + sb * (model.kv_lora_rank - model.qk_rope_head_dim + 1)
        extra += sb * (model.q_lora_rank + 1) if model.q_lora_rank else 0
    if model.qk_norm != "none" and model.attention != "mla":
        kv = max(model.kv_heads // t, 1)
        inputs = sb * (model.q_dim // t + kv * model.head_size)
        rms = sb * (a // t + kv) if model.qk_norm == "head" else 2 * sb
        extra += (2 if shape.recompute == "selective" else 1) * inputs + rms
    return extra


def _mla_elements(model: ModelConfig, sb: int, t: int, recompute: str) -> int:
    """Multi-latent attention's own tensors (model/mla.py), for the a / t heads of the rank (see the module
    docstring); the down-projections and their norms are whole on every tensor-parallel rank."""
    heads, nope, rope, v = model.n_heads // t, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    c, ql = model.kv_lora_rank, model.q_lora_rank
    total = (3 * sb * ql + sb if ql else 0) + sb * (c + rope) + 2 * sb * c + sb
    qk, width = nope + rope, max(nope + rope, v)
    out = sb * heads * v  # wo's input
    if recompute == "selective":  # the core's inputs: q, k and the up-projection whose view v is
        return total + 2 * sb * heads * qk + sb * heads * (nope + v) + out
    values = sb * heads * (width if v < width else nope + v)  # padded values, or the view v
    # q, k (padded to the width), the values, the kernel's output (its heads-first layout is copied for wo)
    # and its log-sum-exp
    return total + 3 * sb * heads * width + values + out + heads * sb


def _qk_norm_elements(model: ModelConfig, sb: int, t: int, kv: int, d: int) -> int:
    """q/k RMSNorms (inside the TP region: whole sequence, this rank's heads): each keeps its fp32 input,
    1/rms and the normalised output; `head` norms per head (1/rms per head), `projection` norms over the
    rank's whole projection (one 1/rms, its sum of squares all-reduced over the group)."""
    heads = model.n_heads // t
    width = 2 * sb * model.q_dim // t + 2 * sb * kv * d
    return width + (sb * (heads + kv) if model.qk_norm == "head" else 2 * sb)


def korthikanti_bytes(model: ModelConfig, shape: ActivationShape) -> int:
    """The paper's per-layer bytes (16-bit, dropout, 4h GELU MLP), for comparison in docs and `info`."""
    s, b, h, a, t = shape.seq_len, shape.micro_batch, model.dim, model.n_heads, shape.tp
    quadratic = 0 if shape.recompute == "selective" else 5 * a * s / h
    if shape.recompute == "full":
        return int(2 * s * b * h)
    if shape.sequence_parallel:
        return int(s * b * h / t * (34 + quadratic))
    if t > 1:
        return int(s * b * h * (10 + 24 / t + quadratic / t))
    return int(s * b * h * (34 + quadratic))


@dataclass(frozen=True)
class ExpertRows:
    """What one rank's MoE layer processes in one micro-batch: its kept assignments and the rows its experts
    compute (None: dropless in one process, k x tokens both), and how the experts are split."""

    assignments: int | None = None
    rows: int | None = None
    ep: int = 1
    etp: int = 1
    kernel: str = "loop"  # `loop` or `grouped` (ExpertKernel's resolved choice)


def moe_mlp_elements(model: ModelConfig, tokens: int, micro_batch: int, rows: ExpertRows = ExpertRows()) -> int:
    """Elements a MoE layer's MLP keeps for backward on one rank (module docstring), `tokens` = s x b."""
    T, E, k, h = tokens, model.n_experts, model.moe_top_k, model.dim
    A = k * T if rows.assignments is None else rows.assignments
    R = A if rows.rows is None else rows.rows
    width = model.expert_hidden_dim // rows.etp
    local = E // rows.ep
    total = T * E + 2 * T * k + (T * k + T if model.moe_norm_topk else 0)
    total += 5 * A + A * h
    total += R * h + 4 * R * width + (4 * R if rows.ep * rows.etp > 1 else 0)
    if rows.kernel == "grouped":
        total += 3 * local * h * width + local
    if model.shared_hidden_dim:
        total += 4 * T * model.shared_hidden_dim + (T * h + T if model.moe_shared_gate else 0)
    sigmoid_norm = T if model.moe_score == "sigmoid" else 0
    if model.moe_aux_loss == "switch":
        total += E + sigmoid_norm
    elif model.moe_aux_loss == "sequence":
        total += micro_batch * E + sigmoid_norm
    if model.moe_z_loss_coeff:
        total += T * E + T
    return total


def moe_block_activation_elements(model: ModelConfig, shape: ActivationShape, rows: ExpertRows = ExpertRows()) -> int:
    """Elements a MoE block keeps for backward on one rank: the dense block's count (either attention) with the MoE
    MLP in place of the SwiGLU. Under tensor parallelism the MoE layer runs outside the region, on the whole
    sequence, or with sequence parallelism on the rank's s / t positions: it keeps the norm's local output where
    the SwiGLU kept its all-gathered input. Full recomputation keeps only the block input either way."""
    dense = block_activation_elements(model, shape)
    if shape.recompute == "full":
        return dense
    s, b, t = shape.seq_len, shape.micro_batch, shape.tp
    tokens = s * b // t if shape.sequence_parallel else s * b
    swiglu = 4 * s * b * model.ffn_hidden_dim // t
    if shape.sequence_parallel and t > 1:
        swiglu += s * b * model.dim - tokens * model.dim  # the gathered input, in place of the local one
    return dense - swiglu + moe_mlp_elements(model, tokens, shape.micro_batch, rows)


def moe_autocast_extra_elements(model: ModelConfig, shape: ActivationShape, rows: ExpertRows = ExpertRows()) -> int:
    """What a MoE block keeps under bf16 autocast over fp32 weights beyond 2 bytes per element of
    `moe_block_activation_elements`, in 2-byte units (measured on the CPU: tests/test_planner.py).

    The attention half and both norms keep what a dense block's do (`autocast_extra_elements`) but for the MLP's
    share, sbh: a dense MLP casts its input for w1 and for w3 where the fp32 count keeps the norm's output once.
    The router runs in fp32 and keeps that output itself, in fp32 (T h more); the loop kernel casts each expert's
    rows for w1 and again for w3 (R h more than the fp32 count's gathered rows; the grouped kernel casts them once);
    the shared experts cast the layer's input for w1 and w3, and the Qwen2-MoE gate once more (2 T h, + T h). The
    int64 indices (chosen experts T k, token and assignment indices 2A, with EP or ETP the regrouping index and
    its inverse 2R) and the grouped kernel's int32 offsets are counted as fp32 elements there: 4 and 2 bytes more
    each; the router's fp32 tensors 2 bytes more each: scores TE, with moe_norm_topk the chosen scores and their
    sum Tk + T, the weights the combine keeps A, the losses' (switch E, sequence bE, + T with sigmoid scores;
    z-loss TE + T)."""
    if shape.recompute == "full":
        return autocast_extra_elements(model, shape)
    s, b, t = shape.seq_len, shape.micro_batch, shape.tp
    tokens = s * b // t if shape.sequence_parallel else s * b
    T, k, h = tokens, model.moe_top_k, model.dim
    A = k * T if rows.assignments is None else rows.assignments
    R = A if rows.rows is None else rows.rows
    extra = autocast_extra_elements(model, shape) - s * b * h
    if rows.kernel == "loop":
        extra += R * h
    else:
        extra += model.n_experts // rows.ep  # int32 offsets
    if model.shared_hidden_dim:
        extra += 2 * T * h + (T * h if model.moe_shared_gate else 0)
    extra += 2 * T * k + 4 * A + (4 * R if rows.ep * rows.etp > 1 else 0)
    # the router runs in fp32 (model/moe.py): it keeps the fp32 layer input (T h more than one bf16 cast), and its
    # scores, normalised choices, the weights the combine keeps and the losses' tensors are fp32, counted as fp32
    # elements above: one unit more each
    extra += T * h + T * model.n_experts + (T * k + T if model.moe_norm_topk else 0) + A
    if model.moe_aux_loss != "none":
        extra += {"switch": model.n_experts, "sequence": shape.micro_batch * model.n_experts}[model.moe_aux_loss]
        extra += T if model.moe_score == "sigmoid" else 0
    if model.moe_z_loss_coeff:
        extra += T * model.n_experts + T
    return extra
