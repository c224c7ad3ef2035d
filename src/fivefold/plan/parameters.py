"""Parameters one rank holds under tensor, pipeline and expert parallelism, counted tensor by tensor.

The count follows what the runtime builds (parallel/tensor_parallel.py, pipeline/stages.py,
parallel/expert_parallel.py), before ZeRO shards anything:

    embedding   vocab-parallel: V_t / t x h rows on the first stage, V_t = V padded to a multiple of t
    head        column-parallel over the vocabulary, V_t / t x h, and the final norm h, on the last stage;
                a tied head is the embedding itself with pp = 1, a second copy on the last stage with pp > 1
    attention   wq h x q/t, wo q/t x h; wk, wv h x kv_t where kv_t = max(n_kv / t, 1) heads of width d
                (split when t <= n_kv, one replicated head otherwise); biases cut with their rows, wo's
                bias whole; q/k norms: `head` gains whole (2d), `projection` gains cut like the rows
    MLA         W_q or W_qa (h x r_q) and its norm whole, W_qb r_q x H/t (n + r), W_kva h x (r_kv + r) and
                its norm whole, W_kvb r_kv x H/t (n + v), W_o H/t v x h
    dense MLP   w1, w3 h x f/t, w2 f/t x h; biases 2f/t + h
    MoE MLP     router h x E and shared experts 3 h f_s (+ h for the gate) whole; E/EP routed experts of
                3 h f_e / ETP each
    norms       2h per block, replicated

`rank_tensors` counts the tensors AdamW updates on the rank (the optimizer's fixed cost per tensor): the
parameter tensors (tensor and expert parallelism cut tensors, never add or remove them), or under ZeRO the flat
groups (parallel/flat_groups.py: a block's decay and no-decay groups and one per routed expert it holds, one
per root module).

The test checks the count against `Parallelized.parameters`, the runtime's sum over its modules,
for tensor, pipeline (interleaved too), tied-head, GQA-replica, bias, MLA and expert layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from fivefold.model.config import ModelConfig

_TP_SPLIT = (".attention.", ".feed_forward.w")  # column- or row-parallel weights of a block's regions
_WHOLE = (".wq_a.", ".wkv_a.", ".q_a_norm.", ".kv_a_norm.")  # multi-latent attention's down-projections and latent
# norms are replicated
_ROW_PARALLEL = (".wo.weight", ".w2.weight")  # split along their inputs: each rank keeps every row
_ROW_PARALLEL_BIAS = (".wo.bias", ".w2.bias")  # added after the reduction: whole
_HEADS = (".wq.", ".wk.", ".wv.", ".q_norm.", ".k_norm.")  # cut by whole heads (a kv head replicated past n_kv)


@dataclass(frozen=True)
class RankParameters:
    """Ψ on one rank, split into what data parallelism shards over dp x cp and what over expert data parallelism."""

    dense: int
    experts: int  # routed experts (EDP-sharded under ZeRO)

    @property
    def total(self) -> int:
        return self.dense + self.experts


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def local_tensor(name: str, shape: tuple[int, ...], vocab: int, tp: int = 1, etp: int = 1,
                 head_size: int = 0) -> tuple[int, int]:
    """(elements, rows) of the parameter `name` of full `shape` as one rank holds it: the vocabulary rows (padded V)
    by tp; a block's attention and dense-MLP weights by tp, column-parallel ones (and their biases, and projection
    q/k norms) along their output features, never below one head of `head_size` (a key/value head replicated
    where tp exceeds the kv heads), row-parallel ones (wo, w2) along their inputs with their biases whole; routed
    experts by etp the same way; the rest (norms, MLA's down-projections and latent norms, router, shared experts)
    whole. rows: the local first dimension of a matrix, 0 for a vector (the shape PowerSGD factorises,
    comm/compression.py)."""
    numel, rows = math.prod(shape), (shape[0] if len(shape) >= 2 else 0)
    if name.startswith(("tok_embeddings.", "output.")):
        return vocab // tp * shape[-1], vocab // tp
    if ".experts." in name:
        split = etp
    elif any(part in name for part in _TP_SPLIT) and not any(x in name for x in _WHOLE):
        split = tp
    else:
        return numel, rows
    if name.endswith(_ROW_PARALLEL):
        return numel // split, rows
    if name.endswith(_ROW_PARALLEL_BIAS) or split == 1:
        return numel, rows
    out = max(shape[0] // split, head_size if any(x in name for x in _HEADS) else 0)
    return out * (numel // shape[0]), (out if len(shape) >= 2 else 0)


def powersgd_factors(tensors: list[tuple[int, int]], rank: int) -> tuple[int, int, int]:
    """Values in PowerSGD's two all-reduces (comm/compression.py) over tensors of (elements, rows), and the values
    of state it keeps between steps: each matrix it compresses (r = min(rank, rows, cols), (rows + cols) r <
    rows x cols) sends P (rows x r) in the first and Q (cols x r) in the second and keeps its error (rows x cols)
    and its warm-start Q; every other tensor goes whole in the first."""
    first = second = state = 0
    for numel, rows in tensors:
        cols = numel // rows if rows else 0
        r = min(rank, rows, cols)
        if rows and (rows + cols) * r < rows * cols:
            first, second, state = first + rows * r, second + cols * r, state + numel + cols * r
        else:
            first += numel
    return first, second, state


def powersgd_shares(model: ModelConfig, tp: int, etp: int, rank: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """PowerSGD's (first all-reduce, second all-reduce, kept state) values per gradient value (`powersgd_factors`),
    over the dense parameters and over the routed experts' (tp- and etp-cut as a rank holds them; ratios, so a
    pipeline stage's or expert-parallel rank's share of the model is priced by the whole model's mix of shapes)."""
    return _powersgd_shares(dataclasses.astuple(model), tp, etp, rank)


@functools.lru_cache(maxsize=64)  # a search prices thousands of layouts of one model
def _powersgd_shares(fields: tuple, tp: int, etp: int, rank: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    from fivefold.model import build_model

    model = ModelConfig(*fields)
    tensors = {False: [], True: []}
    for name, p in build_model(model).named_parameters():  # meta device: shapes only
        if p.requires_grad:
            tensors[".experts." in name].append(local_tensor(name, tuple(p.shape), padded_vocab(model.vocab_size, tp),
                                                             tp, etp, model.head_size))
    shares = []
    for experts in (False, True):
        total = sum(n for n, _ in tensors[experts])
        shares.append(tuple(v / total for v in powersgd_factors(tensors[experts], rank)) if total else (1.0, 0.0, 0.0))
    return shares[0], shares[1]


def priority_slice_bytes(model: ModelConfig, tp: int, bucket_mb: float, slice_mb: float, element: int) -> tuple[int, ...]:
    """Bytes of every slice the priority schedule reduces (parallel/comm_schedule.py `plan_slices` over DDP's own
    `make_buckets`, run on this rank's tp-cut tensors in registration order; gradients of `element` bytes)."""
    return _priority_slice_bytes(dataclasses.astuple(model), tp, bucket_mb, slice_mb, element)


@functools.lru_cache(maxsize=64)
def _priority_slice_bytes(fields: tuple, tp: int, bucket_mb: float, slice_mb: float, element: int) -> tuple[int, ...]:
    from types import SimpleNamespace

    import torch

    from fivefold.model import build_model
    from fivefold.parallel.comm_schedule import plan_slices
    from fivefold.parallel.data_parallel import make_buckets

    model = ModelConfig(*fields)
    vocab = padded_vocab(model.vocab_size, tp)
    dtype = {2: torch.bfloat16, 4: torch.float32}[element]
    params = [torch.empty(local_tensor(name, tuple(p.shape), vocab, tp, head_size=model.head_size)[0], device="meta", dtype=dtype)
              for name, p in build_model(model).named_parameters() if p.requires_grad]
    ddp = SimpleNamespace(params=params, buckets=make_buckets(params, bucket_mb, dtype))
    return tuple((s.hi - s.lo) * element for s in plan_slices(ddp, max(1, int(slice_mb * 2**20) // element)))


def _attention(model: ModelConfig, tp: int) -> int:
    h = model.dim
    if model.attention == "mla":
        heads, qk = model.n_heads // tp, model.qk_nope_head_dim + model.qk_rope_head_dim
        if model.q_lora_rank:
            query = h * model.q_lora_rank + model.q_lora_rank + model.q_lora_rank * heads * qk
        else:
            query = h * heads * qk
        kv = (h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
              + model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim))
        return query + kv + heads * model.v_head_dim * h
    d = model.head_size
    q = model.q_dim // tp
    kv = max(model.kv_heads // tp, 1) * d
    total = 2 * h * q + 2 * h * kv
    if model.attention_bias in ("qkv", "all"):
        total += q + 2 * kv + (h if model.attention_bias == "all" else 0)
    return total + _qk_norm_parameters(model, tp)


def _qk_norm_parameters(model: ModelConfig, tp: int) -> int:
    kv = max(model.kv_heads // tp, 1) * model.head_size
    return {"none": 0, "head": 2 * model.head_size, "projection": model.q_dim // tp + kv}[model.qk_norm]


def block_norm_parameters(model: ModelConfig, tp: int = 1) -> int:
    """A block's RMSNorm weights on a tensor-parallel rank: the two block norms, the q/k norms and MLA's query
    and latent norms (counted in `block_parameters` with the rest)."""
    if model.attention == "mla":
        return 2 * model.dim + model.q_lora_rank + model.kv_lora_rank
    return 2 * model.dim + _qk_norm_parameters(model, tp)


def experts_per_rank(model: ModelConfig, ep: int, replicas: int = 0) -> int:
    """Routed experts an expert-parallel rank holds: E / ep, plus EPLB's spare slots (`expert_parallel.replicas`,
    each filled with a replica of a hot expert, parallel/expert_placement.py)."""
    return model.n_experts // ep + replicas


def expert_values(model: ModelConfig, etp: int = 1) -> int:
    """Parameters of one routed expert on a rank (w1, w3, w2; its hidden units split over etp)."""
    return 3 * model.dim * (model.expert_hidden_dim // etp)


def _mlp(model: ModelConfig, layer: int, tp: int, ep: int, etp: int, replicas: int = 0) -> tuple[int, int]:
    """(dense, routed-expert) parameters of one block's MLP on one rank."""
    h = model.dim
    if not model.is_moe_layer(layer):
        f = model.ffn_hidden_dim // tp
        return 3 * h * f + (2 * f + h if model.mlp_bias else 0), 0
    shared = 3 * h * model.shared_hidden_dim + (h if model.moe_shared_gate else 0)
    experts = experts_per_rank(model, ep, replicas) * expert_values(model, etp)
    return h * model.n_experts + shared, experts


def block_parameters(model: ModelConfig, layer: int, tp: int = 1, ep: int = 1, etp: int = 1,
                     replicas: int = 0) -> RankParameters:
    dense, experts = _mlp(model, layer, tp, ep, etp, replicas)
    return RankParameters(_attention(model, tp) + dense + 2 * model.dim, experts)


def first_block(model: ModelConfig, moe: bool) -> int:
    """A block index of the kind asked for (-1 when the model has none)."""
    if not model.n_experts:
        return -1 if moe else 0
    return next((i for i in range(model.n_layers) if model.is_moe_layer(i) == moe), -1)


def rank_parameters(model: ModelConfig, layers: list[int], first: bool, last: bool, tp: int = 1, ep: int = 1,
                    etp: int = 1, pipelined: bool = False, replicas: int = 0) -> RankParameters:
    """Ψ of a rank holding blocks `layers` (and the embedding if `first`, the head if `last`); `replicas`: EPLB's
    spare expert slots per rank."""
    moe = sum(model.is_moe_layer(layer) for layer in layers) if model.n_experts else 0
    dense = experts = 0
    for count, layer in ((len(layers) - moe, first_block(model, False)), (moe, first_block(model, True))):
        if count:  # every dense block has the same count, every MoE block too
            block = block_parameters(model, layer, tp, ep, etp, replicas)
            dense, experts = dense + count * block.dense, experts + count * block.experts
    vocab_rows = padded_vocab(model.vocab_size, tp) // tp * model.dim
    if first:
        dense += vocab_rows
    if last:
        dense += model.dim + (vocab_rows if not model.tie_embeddings or pipelined else 0)
    return RankParameters(dense, experts)


def _block_tensors(model: ModelConfig, layer: int, ep: int, flat: bool, replicas: int = 0) -> int:
    """Tensors AdamW updates for one block on a rank: its parameter tensors, or (ZeRO) its flat groups."""
    routed = experts_per_rank(model, ep, replicas) if model.is_moe_layer(layer) else 0
    if flat:  # decay and no-decay groups (the norms are always there), one per routed expert
        return 2 + routed
    if model.attention == "mla":
        attention = (3 if model.q_lora_rank else 1) + 4  # wq (or wq_a, its norm, wq_b); wkv_a, its norm, wkv_b; wo
    else:
        bias = {"qkv": 3, "all": 4}.get(model.attention_bias, 0)
        attention = 4 + bias + (0 if model.qk_norm == "none" else 2)
    if routed:
        mlp = 1 + (3 if model.shared_hidden_dim else 0) + (1 if model.moe_shared_gate else 0) + 3 * routed
    else:
        mlp = 6 if model.mlp_bias else 3
    return 2 + attention + mlp


def rank_tensors(model: ModelConfig, layers: list[int], first: bool, last: bool, ep: int = 1, pipelined: bool = False,
                 flat: bool = False, replicas: int = 0) -> int:
    """Tensors AdamW updates on a rank holding blocks `layers` (and the embedding if `first`, the final norm and
    head if `last`): parameter tensors, or with `flat` (ZeRO) flat groups."""
    total = sum(_block_tensors(model, layer, ep, flat, replicas) for layer in layers)
    if first:
        total += 1
    if last:
        total += 1 + (0 if model.tie_embeddings and not pipelined else 1)
    return total


@dataclass(frozen=True)
class FlatGroupSizes:
    """Elements of each ZeRO flat group a rank holds, before padding (parallel/flat_groups.py `flat_group_layout`):
    a block's decay group (its matrices) and no-decay group (its norms and biases), one group per routed expert
    slot of a MoE block, and the root's one per top-level module (embedding; final norm, then head)."""

    model: ModelConfig
    blocks: tuple[tuple[int, ...], tuple[int, ...]]  # a dense-MLP block's (decay, no-decay), a MoE block's
    routed: tuple[int, ...]  # a MoE block's routed experts' groups
    embedding: tuple[int, ...]
    head: tuple[int, ...]

    def unit(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(dense, routed) groups of the unit `embedding`, `layers.i` or `head`."""
        if name in ("embedding", "head"):
            return getattr(self, name), ()
        moe = bool(self.model.n_experts) and self.model.is_moe_layer(int(name.split(".")[1]))
        return self.blocks[moe], self.routed if moe else ()

    def of(self, layers: list[int], first: bool, last: bool) -> tuple[list[int], list[int]]:
        """(dense, routed) group sizes of a rank holding blocks `layers`, the embedding if `first`, the head if
        `last`, in forward order."""
        units = (["embedding"] if first else []) + [f"layers.{i}" for i in layers] + (["head"] if last else [])
        parts = [self.unit(u) for u in units]
        return [n for dense, _ in parts for n in dense], [n for _, routed in parts for n in routed]


def flat_group_sizes(model: ModelConfig, tp: int = 1, etp: int = 1, ep: int = 1, replicas: int = 0) -> FlatGroupSizes:
    """The runtime's flat groups on one rank (`FlatGroupSizes`), counted as `block_parameters` counts a block:
    tensors cut as tensor parallelism cuts them, the routed experts as expert parallelism does (E / ep experts plus
    EPLB's spare slots, each expert's hidden units by etp). ZeRO issues one collective per group. (Counted, not
    read off the meta-device model, so that a search never builds one; tests/test_planner.py checks the count
    against `flat_group_layout`, and the simulator's calls, which use it, equal the runtime's.)"""
    blocks = []
    for moe in (False, True):
        if moe and not model.n_experts:
            blocks.append(blocks[0])
            continue
        layer = first_block(model, moe)
        no_decay = block_norm_parameters(model, tp)
        if model.attention != "mla" and model.attention_bias in ("qkv", "all"):
            kv = max(model.kv_heads // tp, 1) * model.head_size
            no_decay += model.q_dim // tp + 2 * kv + (model.dim if model.attention_bias == "all" else 0)
        if model.mlp_bias and not moe:
            no_decay += 2 * (model.ffn_hidden_dim // tp) + model.dim
        blocks.append((block_parameters(model, layer, tp, ep, etp, replicas).dense - no_decay, no_decay))
    routed = (expert_values(model, etp),) * experts_per_rank(model, ep, replicas) if model.n_experts else ()
    vocab_rows = padded_vocab(model.vocab_size, tp) // tp * model.dim
    head = (model.dim,) if model.tie_embeddings else (model.dim, vocab_rows)
    return FlatGroupSizes(model, (blocks[0], blocks[1]), routed, (vocab_rows,), head)
