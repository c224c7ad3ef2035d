"""Megatron-style tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Applied from outside to the plain model by swapping modules (parameter names are kept):

    attention:  wq, wk, wv column-parallel (split by heads), wo row-parallel
    MLP:        w1, w3 column-parallel, w2 row-parallel
    embedding:  vocab-parallel (rows split; out-of-range tokens give zeros, then summed)
    head:       column-parallel over the vocabulary; the loss is the vocab-parallel cross-entropy,
                so no rank ever holds full-vocabulary logits
    norms:      replicated; each norm opens the tensor-parallel region that follows it

Each region is entered once and left once, through the conjugate pairs of autograd functions:

    without SP: enter = copy      (forward identity,   backward all-reduce)
                leave = reduce    (forward all-reduce, backward identity)
    with SP:    enter = gather    (forward all-gather along the sequence, backward reduce-scatter)
                leave = scatter   (forward reduce-scatter along the sequence, backward all-gather)

so per block and micro-batch the forward moves 2 all-reduces of s*b*h values (or 2 all-gathers
plus 2 reduce-scatters of the same total: the same bytes on a ring), and the backward as many.
With SP the norms and residual adds run on s/t of the sequence; their weights then get only the
gradient of their own part, so it is summed over the group.

GQA: with t <= n_kv_heads the key/value heads are split like the query heads; with t a multiple
of n_kv_heads each rank holds the one key/value head its query heads read (replicated t/n_kv
times), and the replicas' gradients are summed. The vocabulary is padded to a multiple of t;
padded rows are zero and their logits are excluded from the softmax, so the loss is unchanged.

The options of the open model families (model/config.py) split like this:
    biases      of column-parallel layers are cut with their rows; of row-parallel layers are
                held whole and added once, after the reduction (with SP their gradient, from
                this rank's part of the sequence, is summed over the group)
    qk_norm     `head`: one gain of head_dim, replicated, its gradient summed over the group
                (each rank's heads contribute their part); `projection` (OLMo 2): the gain is
                cut like the projection's rows and the mean of squares over the whole query
                (key) width is one all-reduce of the local sums of squares
    post norms  (norm_position = post): the attention and MLP inputs enter the region through a
                forward pre-hook, and the norms run after the row-parallel exit, on replicated
                activations (or, with SP, on this rank's part of the sequence)
    MLA         multi-latent attention: W_q / W_qb, W_kvb and W_o split by heads like q and o; the
                down-projections W_qa, W_kva and their norms whole, gradients summed over the group
    MoE MLPs    stay outside the region (no column/row split): the routed experts run on replicated
                tokens (each TP rank the same), or with SP on this rank's part of the sequence, split
                over ranks by expert parallelism (parallel/expert_parallel.py); the router and shared
                experts are replicated, with SP their gradient summed over the group
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.llama import RMSNorm
from fivefold.model.mla import MultiLatentAttention
from fivefold.model.moe import MoE
from fivefold.comm.p2p import Ranks
from fivefold.parallel.collectives import all_gather_flat, conjugate_function, reduce_scatter_flat
from fivefold.parallel.tp_overlap import SharedGather, matmul_reduce_scatter
from fivefold.reliability.activity import phase

IGNORE_INDEX = -100  # label of positions that carry no target token (PyTorch's cross-entropy default)


SEQ_DIM = 1  # activations are (batch, seq, hidden)


# ----------------------------------------------------------------------------- raw collectives
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    with phase("tensor-parallel all-reduce", comm=True):
        dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    with phase("tensor-parallel all-gather", comm=True):
        all_gather_flat(out, local, group=group)
    return out.movedim(0, dim).contiguous()  # one copy here, not one per consuming linear


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    full = x.movedim(dim, 0).contiguous()
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=x.dtype, device=x.device)
    with phase("tensor-parallel reduce-scatter", comm=True):
        reduce_scatter_flat(out, full, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world, dim=dim)[rank].contiguous()


# ------------------------------------------------------------------ conjugate autograd regions
def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x.view_as(x)


# (forward, backward) pairs: each is the other's conjugate.
_CopyToRegion = conjugate_function("CopyToRegion", _identity, _all_reduce)  # f
_ReduceFromRegion = conjugate_function("ReduceFromRegion", lambda x, g: _all_reduce(x.clone(), g), _identity)  # g
_GatherFromSequenceRegion = conjugate_function(  # SP entry
    "GatherFromSequenceRegion", lambda x, g: _all_gather(x, SEQ_DIM, g), lambda d, g: _reduce_scatter(d, SEQ_DIM, g))
_ReduceScatterToSequenceRegion = conjugate_function(  # SP exit
    "ReduceScatterToSequenceRegion", lambda x, g: _reduce_scatter(x, SEQ_DIM, g), lambda d, g: _all_gather(d, SEQ_DIM, g))
_ScatterToSequenceRegion = conjugate_function(
    "ScatterToSequenceRegion", lambda x, g: _split(x, SEQ_DIM, g), lambda d, g: _all_gather(d, SEQ_DIM, g))


class _SumGradOverReplicas(torch.autograd.Function):
    """Forward identity on a replicated weight; backward sums its gradient over the ranks holding it.

    `slot` of `slots` names which replica set this rank belongs to (e.g. which key/value head);
    the ranks of one slot sum their gradients (one all-reduce over the group, zeros elsewhere).
    """

    @staticmethod
    def forward(ctx, weight, group, slot, slots):
        ctx.group, ctx.slot, ctx.slots = group, slot, slots
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        if ctx.slots == 1:
            return _all_reduce(grad, ctx.group), None, None, None
        buffer = grad.new_zeros((ctx.slots, *grad.shape))
        buffer[ctx.slot] = grad
        # a copy: the view would become the weight's .grad and keep the whole buffer (slots x the gradient) alive
        return _all_reduce(buffer, ctx.group)[ctx.slot].clone(), None, None, None


def copy_to_tensor_parallel_region(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    return _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceRegion.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence, without autograd (evaluation, tests)."""
    return _all_gather(x, SEQ_DIM, group)


# -------------------------------------------------------------------------------- the modules
@dataclass(frozen=True)
class TPSpec:
    """How a parameter is split over the tensor-parallel group, to consolidate it and to count its norm.

    dim: the split dimension, or None when every rank holds the whole tensor.
    ranks: the ranks holding distinct pieces, in order (fewer than t when pieces are replicated).
    size: the full length along dim before padding (padding is dropped on consolidation).
    """

    dim: int | None
    ranks: tuple[int, ...]
    size: int

    def replicas(self, tp: int) -> int:
        return tp // len(self.ranks)

    def to_json(self) -> dict:
        return {"dim": self.dim, "ranks": list(self.ranks), "size": self.size}


def tp_spec(param: nn.Parameter) -> TPSpec | None:
    return getattr(param, "tp_spec", None)


def _parameter(value: torch.Tensor, spec: TPSpec) -> nn.Parameter:
    param = nn.Parameter(value.detach().clone().contiguous())
    param.tp_spec = spec
    return param


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local, W and b split by output rows. The input is already in the TP region."""

    def __init__(self, linear: nn.Linear, rows: slice, spec: TPSpec, group, replica_slot: tuple[int, int] | None = None):
        super().__init__()
        self.group, self.replica_slot = group, replica_slot
        self.shared: SharedGather | None = None  # comm_overlap: the region's one all-gather -> matmul ring
        self.weight = _parameter(linear.weight[rows], spec)
        self.bias = None if linear.bias is None else _parameter(linear.bias[rows], spec)

    def effective_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias as the matmul uses them (replicated key/value heads sum their gradients)."""
        weight, bias = self.weight, self.bias
        if self.replica_slot is not None:
            weight = _SumGradOverReplicas.apply(weight, self.group, *self.replica_slot)
            if bias is not None:
                bias = _SumGradOverReplicas.apply(bias, self.group, *self.replica_slot)
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:  # communication overlap: x is this rank's part of the sequence
            return self.shared.output(self, x)
        return F.linear(x, *self.effective_parameters())


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local W_local^T, then + b once; W split by input columns; leaves the TP region."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool, overlap: bool = False):
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        cols = linear.in_features // tp
        self.group, self.sequence_parallel = group, sequence_parallel
        self.ranks = Ranks.of_group(group) if overlap else None  # reduce-scatter overlapped with the matmul
        self.weight = _parameter(linear.weight[:, rank * cols : (rank + 1) * cols], TPSpec(1, tuple(range(tp)), linear.in_features))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ranks is not None:
            y = matmul_reduce_scatter(x, self.weight, self.ranks)
        elif self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.group)
        else:
            y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        if self.bias is None:
            return y
        bias = _SumGradOverReplicas.apply(self.bias, self.group, 0, 1) if self.sequence_parallel else self.bias
        return y + bias


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """Rows [r V'/t, (r+1) V'/t) of the (padded) table; tokens held elsewhere look up zeros, then sum."""

    def __init__(self, embedding: nn.Embedding, group, sequence_parallel: bool):
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        vocab, dim = embedding.weight.shape
        self.per_rank = padded_vocab_size(vocab, tp) // tp
        self.start = rank * self.per_rank
        table = embedding.weight.new_zeros((self.per_rank, dim))
        real = embedding.weight[self.start : min(self.start + self.per_rank, vocab)]
        table[: real.shape[0]] = real
        self.weight = _parameter(table, TPSpec(0, tuple(range(tp)), vocab))
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.start + self.per_rank)
        local = F.embedding((tokens - self.start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(local, self.group)
        return reduce_from_tensor_parallel_region(local, self.group)


class ParallelRMSNorm(RMSNorm):
    """RMSNorm (same weight) whose output enters the tensor-parallel region of the layer after it.

    With SP it runs on this rank's part of the sequence and its weight gradient is summed over the group.
    """

    def __init__(self, norm: RMSNorm, group, sequence_parallel: bool, gather: bool = True):
        nn.Module.__init__(self)
        self.eps, self.weight = norm.eps, norm.weight
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gather = gather  # False: the layers after it gather while they multiply (comm_overlap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            weight = _SumGradOverReplicas.apply(self.weight, self.group, 0, 1)
            if not self.gather:
                return weight * self.normalize(x)
            return gather_from_sequence_parallel_region(weight * self.normalize(x), self.group)
        return copy_to_tensor_parallel_region(self.weight * self.normalize(x), self.group)


class SequenceShardNorm(RMSNorm):
    """A post-branch RMSNorm (OLMo 2) outside the TP region: replicated activations, or with SP this
    rank's part of the sequence, whose weight gradient is then summed over the group."""

    def __init__(self, norm: RMSNorm, group, sequence_parallel: bool):
        nn.Module.__init__(self)
        self.eps, self.weight = norm.eps, norm.weight
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _SumGradOverReplicas.apply(self.weight, self.group, 0, 1) if self.sequence_parallel else self.weight
        return weight * self.normalize(x)


class HeadNorm(RMSNorm):
    """Qwen3's per-head query/key RMSNorm inside the TP region: one replicated gain of head_dim that
    this rank's heads use; the gradient is summed over the group (every rank's heads have a part)."""

    def __init__(self, norm: RMSNorm, group):
        nn.Module.__init__(self)
        self.eps, self.weight, self.group = norm.eps, norm.weight, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumGradOverReplicas.apply(self.weight, self.group, 0, 1) * self.normalize(x)


_AllReduceSum = conjugate_function("AllReduceSum", lambda x, g: _all_reduce(x.clone(), g), lambda d, g: _all_reduce(d.clone(), g))


class ProjectionNorm(nn.Module):
    """OLMo 2's RMSNorm over a whole query (key) projection whose rows are split over the group.

    mean(x^2) over the full width is the all-reduced sum of the local sums of squares over the full
    width; with key heads replicated `replicas` times each distinct head's sum is counted that many
    times, so the total is divided by it. The gain is cut like the rows.
    """

    def __init__(self, norm: RMSNorm, rows: slice, spec: TPSpec, group, replica_slot: tuple[int, int] | None = None):
        super().__init__()
        self.eps, self.group, self.replica_slot = norm.eps, group, replica_slot
        self.width = norm.weight.shape[0]
        self.replicas = dist.get_world_size(group) // len(spec.ranks)
        self.weight = _parameter(norm.weight[rows], spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        total = _AllReduceSum.apply(x32.pow(2).sum(-1, keepdim=True), self.group) / self.replicas
        normalized = (x32 * torch.rsqrt(total / self.width + self.eps)).to(x.dtype)
        weight = self.weight
        if self.replica_slot is not None:
            weight = _SumGradOverReplicas.apply(weight, self.group, *self.replica_slot)
        return weight * normalized


# ----------------------------------------------------------------------- vocab-parallel loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits (N, V/t): max, sum of exps and target logit all-reduced."""

    @staticmethod
    def forward(ctx, logits, labels, start, vocab_size, group, ignore_index):
        logits = logits.float()
        per_rank = logits.shape[-1]
        padded = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, float("-inf"))
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - top.unsqueeze(-1)).exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < per_rank)
        index = local.clamp(0, per_rank - 1).unsqueeze(-1)
        target = torch.where(mine, logits.gather(-1, index).squeeze(-1) - top, torch.zeros_like(top))
        target = _all_reduce(target, group)
        loss = torch.where(valid, sum_exp.log() - target, torch.zeros_like(top))
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), mine, index, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, mine, index, valid = ctx.saved_tensors
        grad = softmax.scatter_add(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        grad = grad * (grad_loss * valid).unsqueeze(-1)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token losses (flattened) from this rank's slice of the padded vocabulary."""
    start = dist.get_rank(group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), start, vocab_size, group,
                                            ignore_index)


# ---------------------------------------------------------------------------------- applying
def check_tensor_parallel(config: ModelConfig, tp: int, sequence_parallel: bool, seq_len: int,
                          comm_overlap: bool = False) -> None:
    """Raise ConfigError, naming the setting, when the model cannot be split tp ways."""
    if comm_overlap and config.norm_position == "post":
        raise ConfigError("tensor_parallel.comm_overlap gathers in the layers after a pre-norm; model.norm_position = "
                          "post enters the region before the branch: turn comm_overlap off for this family")
    if comm_overlap and config.attention == "mla":
        raise ConfigError("tensor_parallel.comm_overlap is not built for multi-latent attention (model.attention = mla): "
                          "turn it off")
    if tp == 1:
        if sequence_parallel:
            raise ConfigError("tensor_parallel.sequence_parallel needs tensor_parallel.degree > 1")
        return
    if config.n_heads % tp:
        raise ConfigError(f"tensor_parallel.degree = {tp} must divide model.n_heads = {config.n_heads}")
    kv = config.kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"tensor_parallel.degree = {tp} and model.n_kv_heads = {kv}: one must divide the other "
                          "(kv heads are split when tp <= n_kv_heads, replicated when tp is a multiple)")
    if config.ffn_hidden_dim % tp:
        raise ConfigError(f"tensor_parallel.degree = {tp} must divide the MLP width {config.ffn_hidden_dim} (model.ffn_hidden_dim)")
    if sequence_parallel and seq_len % tp:
        raise ConfigError(f"tensor_parallel.sequence_parallel splits train.seq_len = {seq_len} in tensor_parallel.degree = {tp}: "
                          "make seq_len a multiple of tp")


def _kv_rows(config: ModelConfig, group) -> tuple[slice, TPSpec, tuple[int, int] | None]:
    """This rank's rows of a key/value projection, their spec, and its replica slot (None when split)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    kv, hd = config.kv_heads, config.head_size
    if kv % tp == 0:  # split the kv heads
        per = kv // tp * hd
        return slice(rank * per, (rank + 1) * per), TPSpec(0, tuple(range(tp)), kv * hd), None
    replicas = tp // kv  # each kv head is read by tp / kv ranks' query heads
    head = rank // replicas
    return slice(head * hd, (head + 1) * hd), TPSpec(0, tuple(range(0, tp, replicas)), kv * hd), (head, kv)


def _kv_linear(linear: nn.Linear, config: ModelConfig, group) -> ColumnParallelLinear:
    rows, spec, slot = _kv_rows(config, group)
    return ColumnParallelLinear(linear, rows, spec, group, replica_slot=slot)


class _ReplicaGradSum:
    """A MoE layer's `replicated`: its router and shared experts' gradients summed over the group (SP)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return _SumGradOverReplicas.apply(weight, self.group, 0, 1)


def _enter_region_hook(group, sequence_parallel: bool):
    """Forward pre-hook: the branch input (first argument) enters the TP region (post-norm blocks)."""
    enter = gather_from_sequence_parallel_region if sequence_parallel else copy_to_tensor_parallel_region

    def hook(module, args):
        return (enter(args[0], group), *args[1:])
    return hook


def _split_attention(attention, config: ModelConfig, column, group, sequence_parallel: bool,
                     comm_overlap: bool = False) -> None:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    everyone = tuple(range(tp))
    attention.wq = column(attention.wq)
    attention.wk = _kv_linear(attention.wk, config, group)
    attention.wv = _kv_linear(attention.wv, config, group)
    attention.wo = RowParallelLinear(attention.wo, group, sequence_parallel, comm_overlap)
    if config.qk_norm == "head":
        attention.q_norm, attention.k_norm = HeadNorm(attention.q_norm, group), HeadNorm(attention.k_norm, group)
    elif config.qk_norm == "projection":
        per = config.q_dim // tp
        attention.q_norm = ProjectionNorm(attention.q_norm, slice(rank * per, (rank + 1) * per),
                                          TPSpec(0, everyone, config.q_dim), group)
        rows, spec, slot = _kv_rows(config, group)
        attention.k_norm = ProjectionNorm(attention.k_norm, rows, spec, group, slot)


class ReplicatedLinear(nn.Module):
    """A whole weight inside the TP region (MLA's down-projections): each rank's heads use its output, so
    its gradient is summed over the group."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.weight, self.group = linear.weight, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _SumGradOverReplicas.apply(self.weight, self.group, 0, 1))


def _split_mla(attention, column, group, sequence_parallel: bool) -> None:
    """Multi-latent attention: query up-projection, key/value up-projection and output split by heads; the
    down-projections and their norms replicated (gradients summed)."""
    if attention.wq is not None:
        attention.wq = column(attention.wq)
    else:
        attention.wq_a = ReplicatedLinear(attention.wq_a, group)
        attention.q_a_norm = HeadNorm(attention.q_a_norm, group)
        attention.wq_b = column(attention.wq_b)
    attention.wkv_a = ReplicatedLinear(attention.wkv_a, group)
    attention.kv_a_norm = HeadNorm(attention.kv_a_norm, group)
    attention.wkv_b = column(attention.wkv_b)
    attention.wo = RowParallelLinear(attention.wo, group, sequence_parallel)


def _overlap(block, attention, mlp, group) -> None:
    """comm_overlap: the block's norms stop gathering; the column-parallel layers of each region share one
    all-gather -> matmul ring, and the row-parallel exits reduce-scatter while they multiply (tp_overlap.py)."""
    ranks = Ranks.of_group(group)
    regions = [(block.attention_norm, [attention.wq, attention.wk, attention.wv])]
    if not isinstance(mlp, MoE):
        regions.append((block.ffn_norm, [mlp.w1, mlp.w3]))
    for norm, consumers in regions:
        norm.gather = False
        shared = SharedGather(ranks)
        for layer in consumers:
            layer.shared = shared
            shared.members.append(layer)


@torch.no_grad()
def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False, comm_overlap: bool = False) -> None:
    """Swap the model's layers for their tensor-parallel versions, slicing the (materialised) weights.

    comm_overlap (needs sequence_parallel): the sequence all-gathers and reduce-scatters of each block run as
    collective matmuls, overlapped chunk by chunk with the matmuls that need them (tp_overlap.py)."""
    config: ModelConfig = model.config
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    everyone = tuple(range(tp))

    def column(linear: nn.Linear) -> ColumnParallelLinear:
        per = linear.out_features // tp
        return ColumnParallelLinear(linear, slice(rank * per, (rank + 1) * per), TPSpec(0, everyone, linear.out_features), group)

    for block in model.layers.values():
        attention, mlp = block.attention, block.feed_forward
        moe = isinstance(mlp, MoE)
        if isinstance(attention, MultiLatentAttention):
            _split_mla(attention, column, group, sequence_parallel)
        else:
            _split_attention(attention, config, column, group, sequence_parallel, comm_overlap)
        if moe:  # outside the TP region: on replicated tokens, or with SP on this rank's (parallel/expert_parallel.py)
            if sequence_parallel:
                mlp.replicated = _ReplicaGradSum(group)
        else:
            mlp.w1, mlp.w3 = column(mlp.w1), column(mlp.w3)
            mlp.w2 = RowParallelLinear(mlp.w2, group, sequence_parallel, comm_overlap)
        if config.norm_position == "post":
            for branch in (attention, mlp):
                if branch is not mlp or not moe:
                    branch.register_forward_pre_hook(_enter_region_hook(group, sequence_parallel))
            block.attention_norm = SequenceShardNorm(block.attention_norm, group, sequence_parallel)
            block.ffn_norm = SequenceShardNorm(block.ffn_norm, group, sequence_parallel)
        else:
            block.attention_norm = ParallelRMSNorm(block.attention_norm, group, sequence_parallel)
            block.ffn_norm = (SequenceShardNorm if moe else ParallelRMSNorm)(block.ffn_norm, group, sequence_parallel)
            if comm_overlap:
                _overlap(block, attention, mlp, group)
    # A pipeline stage may hold neither the embedding nor the head.
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, sequence_parallel)
    if model.norm is not None:
        model.norm = ParallelRMSNorm(model.norm, group, sequence_parallel)
    if model.output is not None:
        padded = padded_vocab_size(config.vocab_size, tp)
        head = nn.Linear(config.dim, padded, bias=False, device=model.output.weight.device)
        head.weight.zero_()
        head.weight[: config.vocab_size] = model.output.weight
        model.output = ColumnParallelLinear(head, slice(rank * padded // tp, (rank + 1) * padded // tp),
                                            TPSpec(0, everyone, config.vocab_size), group)
