"""Mixture-of-experts MLP: top-k routing over SwiGLU experts (Shazeer et al. 2017; Fedus et al. 2021, Switch
Transformer; Jiang et al. 2024, Mixtral; DeepSeek-AI 2024, DeepSeek-V3).

    scores    router logits x W_r^T in fp32 -> softmax over the E experts, or a sigmoid per expert
    select    the top-k experts of (scores + bias); the bias is DeepSeek-V3's auxiliary-loss-free
              balancing term (a buffer moved after each step towards even load; it changes which
              experts are chosen, never the weights). With group-limited routing (DeepSeek-V3's
              n_group / topk_group) only the experts of the moe_topk_groups groups whose two best
              selection scores sum highest are candidates
    weights   the chosen scores, renormalised to sum to 1 (moe_norm_topk), times moe_route_scale
    capacity  with moe_capacity_factor c > 0, expert e takes at most ceil(c * S * k / E) of one
              sequence's S tokens; the others are dropped for that expert (lowest score first, or
              latest position first). Deciding per sequence makes the drops the same under any
              batch split, data or expert parallelism
    experts   assignments sorted by expert, each expert's contiguous rows through its SwiGLU
              (`ExpertKernel`: one grouped GEMM, or one matmul per expert; never a loop over tokens),
              then weighted and summed back per token
    shared    optional shared experts every token passes through (DeepSeek, Qwen-MoE), optionally
              gated by sigmoid(x . w) (Qwen2-MoE)

Balancing losses, added to the objective with weight moe_aux_coeff (and moe_z_loss_coeff):
    switch    E * sum_i f_i P_i over the tokens of one micro-batch of the whole job, f_i the fraction
              of the k*T assignments that chose expert i and P_i the mean probability of expert i
    sequence  the same over each sequence, averaged over the sequences (DeepSeek-V3)
    z-loss    mean over tokens of logsumexp(logits)^2 (Zoph et al. 2022, ST-MoE)
Counts that span ranks (a micro-batch split over data-parallel ranks, a sequence over context or
sequence-parallel ranks) are all-reduced over `RoutingGroups`, and each rank adds the terms of its
own tokens' probabilities, so the sum over ranks is exactly the single-process loss and its gradient
needs no collective. The loss enters backward through `_AttachLoss` on the block output (as
Megatron-Core's auxiliary-loss scaler does), so the model still returns plain logits.

Where the expert computation runs is the dispatcher's business: `LocalDispatch` here, expert
parallelism's all-to-all in parallel/expert_parallel.py. Experts are modules keyed by their global
index (`experts.5.w1.weight`, Hugging Face's Mixtral names), so an expert-parallel rank keeps only its
own and checkpoints name every expert the same way at any expert-parallel degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.model.config import ModelConfig
from fivefold.model.layers import FeedForward, matmul_dtype

EXPERT_KERNELS = ("auto", "grouped", "loop")


def _identity(weight: torch.Tensor) -> torch.Tensor:
    return weight


@dataclass
class RoutingGroups:
    """Ranks whose tokens one routing statistic covers (set by parallel code; all None in one process).

    tokens:   the ranks holding distinct tokens of one micro-batch (data x context, x tensor with SP)
    sequence: the ranks holding distinct parts of one sequence (context, x tensor with SP)
    """

    tokens: dist.ProcessGroup | None = None
    token_ranks: int = 1
    sequence: dist.ProcessGroup | None = None
    sequence_ranks: int = 1


@dataclass
class RoutingStats:
    """What one MoE layer measured since the last `take` (filled during backward, so recomputation counts once).

    Between takes the sums stay tensors on the device that made them: reading one on the host in every MoE
    layer's forward or backward made the host wait for the GPU there, so kernel launches could not run ahead
    of it. `take` (once per step, in train/routing_report.py) brings them to the host as floats."""

    experts: int
    load: torch.Tensor = None  # assignments per expert, before drops (float64)
    dropped: float | torch.Tensor = 0.0
    assignments: float = 0.0
    aux_loss: float | torch.Tensor = 0.0
    z_loss: float | torch.Tensor = 0.0
    micro_batches: int = 0
    max_received: int = 0  # most rows one expert-parallel rank received in a dispatch
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.load = torch.zeros(self.experts, dtype=torch.float64, device="cpu")

    def record(self, load: torch.Tensor, dropped: int | torch.Tensor, assignments: int, aux: float | torch.Tensor,
               z: float | torch.Tensor) -> None:
        load = load.detach().double()
        # the first load replaces the host's zeros, so nothing is copied to the device (a wait of its own)
        self.load = self.load + load if self.micro_batches else load.clone()
        self.dropped = self.dropped + dropped
        self.assignments += assignments
        self.aux_loss = self.aux_loss + aux
        self.z_loss = self.z_loss + z
        self.micro_batches += 1

    def take(self) -> "RoutingStats":
        """What was recorded since the last take, on the host (load a CPU tensor, the rest floats); starts anew."""
        out = RoutingStats(self.experts)
        out.load, out.dropped, out.assignments = self.load.to("cpu", copy=True), float(self.dropped), self.assignments
        out.aux_loss, out.z_loss, out.micro_batches, out.max_received = (float(self.aux_loss), float(self.z_loss),
                                                                        self.micro_batches, self.max_received)
        self.__init__(self.experts)
        return out


class _AttachLoss(torch.autograd.Function):
    """Forward: identity on the block output. Backward: the auxiliary loss gets gradient `scale`, and the
    layer's routing statistics are recorded (once per micro-batch even when the block is recomputed)."""

    @staticmethod
    def forward(ctx, out, loss, scale, stats, record):
        ctx.scale, ctx.stats, ctx.record = scale, stats, record
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.stats.record(*ctx.record)
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=torch.float32, device=grad.device), None, None, None


def _all_reduce(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(value, group=group)
    return value


def capacity_mask(experts: torch.Tensor, weights: torch.Tensor, n_experts: int, capacity: int,
                  policy: str) -> torch.Tensor:
    """Which (token, choice) assignments of each sequence fit their expert's capacity.

    experts, weights: (batch, seq, k). Within one sequence and one expert, assignments are ranked by
    weight (policy `probability`, ties to the earlier position) or by position (`position`); the first
    `capacity` are kept. Vectorised: two stable sorts, no loop over tokens.
    """
    batch, seq, k = experts.shape
    flat = experts.reshape(batch, seq * k)
    if policy == "probability":
        priority = torch.argsort(-weights.reshape(batch, seq * k), dim=1, stable=True)
    else:
        priority = torch.arange(seq * k, device=flat.device).expand(batch, -1)
    by_expert = torch.argsort(flat.gather(1, priority), dim=1, stable=True)
    order = priority.gather(1, by_expert)  # assignments grouped by expert, best first within each
    grouped = flat.gather(1, order)
    counts = F.one_hot(flat, n_experts).sum(1)  # (batch, E)
    starts = counts.cumsum(1) - counts
    rank = torch.arange(seq * k, device=flat.device) - starts.gather(1, grouped)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep.scatter_(1, order, rank < capacity)
    return keep.view(batch, seq, k)


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of `ids` name each of `n_experts` experts (int64, on ids' device): `torch.bincount`'s answer,
    without the wait for the GPU that CUDA's bincount makes to size its output (it reads the largest id)."""
    return torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def expert_capacity(config: ModelConfig, seq: int) -> int:
    """Assignments one expert takes from one sequence of `seq` tokens (0: dropless)."""
    if not config.moe_capacity_factor:
        return 0
    return math.ceil(config.moe_capacity_factor * seq * config.moe_top_k / config.n_experts)


def auto_expert_kernel(dim: int, hidden: int, element_size: int) -> str:
    """`auto`'s choice where torch has its grouped GEMM: `grouped` when the experts' widths meet its 16-byte
    alignment, else `loop` (the planner asks the same, plan/estimate.py expert_rows)."""
    align = 16 // element_size
    return "grouped" if dim % align == 0 and hidden % align == 0 else "loop"


def resolve_expert_kernel(kind: str, dim: int, hidden: int, element_size: int) -> str:
    """`kind` (expert_parallel.kernel) as the experts run it: `auto` is `grouped` where this torch has its grouped
    GEMM and the widths meet its alignment (`auto_expert_kernel`), else `loop`."""
    if kind != "auto":
        return kind
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    return auto_expert_kernel(dim, hidden, element_size)


class ExpertKernel:
    """Runs a list of experts over rows already sorted by expert (`counts[i]` rows for expert i).

    `grouped` stacks the experts' weights as they are stored, (out, in), and calls torch's grouped GEMM
    (`torch._grouped_mm`), one kernel per projection; `loop` runs one matmul per expert on its slice. `auto` takes `grouped` where
    torch has it and the widths meet its 16-byte alignment, else `loop` (benchmarks/moe.py and benchmarks/plan_vs_gpu.py
    measure both).
    """

    def __init__(self, kind: str = "auto"):
        if kind not in EXPERT_KERNELS:
            raise ValueError(f"expert kernel {kind!r}: one of {EXPERT_KERNELS}")
        self.kind = kind

    def resolve(self, x: torch.Tensor, experts: list[FeedForward]) -> str:
        if not experts:
            return "loop" if self.kind == "auto" else self.kind
        element = torch.finfo(matmul_dtype(x)).bits // 8
        return resolve_expert_kernel(self.kind, experts[0].w1.in_features, experts[0].w1.out_features, element)

    def __call__(self, x: torch.Tensor, counts: list[int] | torch.Tensor, experts: list[FeedForward]) -> torch.Tensor:
        """`counts` on the host, or as a tensor on x's device: the grouped kernel then never reads it on the host
        (the loop kernel must, to slice the rows)."""
        if x.shape[0] == 0:
            # keep every expert weight in the graph, so its gradient is a (zero) tensor on every rank
            return x + 0.0 * sum(p.sum() for e in experts for p in e.parameters())
        if self.resolve(x, experts) == "grouped":
            return self._grouped(x, counts, experts)
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        outputs, start = [], 0
        for expert, n in zip(experts, counts):
            # an expert without rows still runs (on none), so its gradient exists (zeros) on every rank
            outputs.append(expert(x[start : start + n]))
            start += n
        return torch.cat(outputs)

    @staticmethod
    def _grouped(x: torch.Tensor, counts: list[int] | torch.Tensor, experts: list[FeedForward]) -> torch.Tensor:
        counts = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x.device)
        offsets = counts.cumsum(0).to(torch.int32)
        # autocast casts neither torch._grouped_mm nor an autograd.Function: cast as it casts the loop kernel's
        # Linear layers, or the experts' GEMMs run (and keep their stacked weights) in fp32 under bf16 autocast
        dtype = matmul_dtype(x)
        x = x.to(dtype)

        def stacked(name: str) -> torch.Tensor:
            weights = [getattr(e, name).weight for e in experts]
            # nothing to cast: one stack is fewer operators (on a CPU, 50 us less per forward and backward)
            return torch.stack(weights) if weights[0].dtype == dtype else _StackCast.apply(dtype, *weights)

        gate = _GroupedMM.apply(x, stacked("w1"), offsets)
        up = _GroupedMM.apply(x, stacked("w3"), offsets)
        return _GroupedMM.apply(F.silu(gate) * up, stacked("w2"), offsets)


class _StackCast(torch.autograd.Function):
    """The experts' weights stacked (E, out, in) in another `dtype`, copied and cast in one pass (one foreach copy).

    `torch.stack(weights).to(dtype)` wrote the stack in the weights' own dtype first and cast it after: under
    bf16 autocast with fp32 weights, 14 bytes of memory traffic per element where the cast alone needs 6 (a
    forward of 4 Qwen3-30B-A3B layers, 2.4G expert weights, moved 19 GB more). Backward is theirs, bit for bit:
    the stack's gradient cast back to the weights' dtype once, then split by expert."""

    @staticmethod
    def forward(ctx, dtype, *weights):
        ctx.weight_dtype = weights[0].dtype
        stack = weights[0].new_empty((len(weights), *weights[0].shape), dtype=dtype)
        torch._foreach_copy_(list(stack.unbind(0)), list(weights))
        return stack

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.to(ctx.weight_dtype).unbind(0))


class _GroupedMM(torch.autograd.Function):
    """x @ weights[e].T for each expert's rows, weights stacked (E, out, in) as nn.Linear stores them.

    The weight gradient is computed in that same layout, grad.T @ x per expert, so each expert's slice
    is contiguous and lands in its .grad without a copy; taking the gradient of a transposed stack
    instead cost a strided 256 x 256 copy per expert and projection (with the row gather's index_put,
    a fifth of a tiny-moe step on a CPU). The incoming gradient is made contiguous: the CPU kernel
    rejects expanded ones."""

    @staticmethod
    def forward(ctx, x, weights, offsets):
        ctx.save_for_backward(x, weights, offsets)
        return torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weights, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, weights, offs=offsets)
        grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)
        return grad_x, grad_w, None


@dataclass
class Routing:
    """One micro-batch's routing: flat (T, k) expert ids and weights, and which assignments are kept."""

    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor | None

    def sorted_assignments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(assignment indices sorted by expert, stable; their expert ids) of the kept assignments."""
        flat = self.experts.reshape(-1)
        chosen = torch.arange(flat.numel(), device=flat.device)
        if self.keep is not None:
            chosen = chosen[self.keep.reshape(-1)]
        ids = flat[chosen]
        order = torch.argsort(ids, stable=True)
        return chosen[order], ids[order]


def limit_to_groups(select: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """Selection scores (tokens, E) with every expert outside each token's `keep` best groups set to -inf;
    a group's rank is the sum of its two best scores (DeepSeek-V3)."""
    grouped = select.view(select.shape[0], groups, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1)  # (tokens, groups)
    chosen = best.topk(keep, dim=-1).indices
    allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(select)


def load_expert_biases(modules, biases: dict[str, list[float]]) -> None:
    """Set the selection biases of the MoE layers among `modules` from {layer index: bias} (trainer.json's expert_bias)."""
    for module in modules:
        if isinstance(module, MoE) and str(module.layer_id) in biases:
            with torch.no_grad():
                module.expert_bias.copy_(torch.tensor(biases[str(module.layer_id)], dtype=module.expert_bias.dtype))


class LocalDispatch:
    """All experts on this rank: permute by expert, run them, weight and sum back."""

    def __call__(self, x: torch.Tensor, routing: Routing, moe: "MoE") -> torch.Tensor:
        assignments, ids = routing.sorted_assignments()
        k = routing.experts.shape[1]
        tokens = assignments // k
        counts = expert_counts(ids, moe.n_experts)  # stays on the device: see ExpertKernel.__call__
        out = moe.kernel(x.index_select(0, tokens), counts, moe.local_experts())
        return combine(x, out, tokens, routing.weights.reshape(-1)[assignments])


def combine(x: torch.Tensor, expert_out: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over each token's kept assignments of weight * expert output, in x's dtype."""
    return _Combine.apply(expert_out, weights, tokens, x)


class _Combine(torch.autograd.Function):
    """The combine, keeping only the expert rows as they came (and the weights and token indices) for backward.

    Written with autograd's ops it kept two more copies of every returned row: the fp32 rows the weight
    multiplies (for the weights' gradient) and the weighted rows `index_add` saves (it keeps its source,
    only for its shape). Under bf16 autocast, with the residual stream in fp32, both were fp32: 8 bytes
    per returned element beside the bf16 rows themselves. The arithmetic is the same, in fp32, in forward
    and backward."""

    @staticmethod
    def forward(ctx, expert_out, weights, tokens, x):
        ctx.save_for_backward(expert_out, weights, tokens)
        weighted = (expert_out.float() * weights.unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add(0, tokens, weighted)

    @staticmethod
    def backward(ctx, grad):
        expert_out, weights, tokens = ctx.saved_tensors
        rows = grad.index_select(0, tokens).float()  # each assignment's token's gradient
        grad_rows = (rows * weights.unsqueeze(1)).to(expert_out.dtype) if ctx.needs_input_grad[0] else None
        grad_weights = (rows * expert_out.float()).sum(1).to(weights.dtype) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weights, None, None


class MoE(nn.Module):
    """The routed (and shared) experts of one block, in place of its dense MLP."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.config, self.layer_id = config, layer_id
        self.n_experts, self.top_k = config.n_experts, config.moe_top_k
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(i): FeedForward(config.dim, config.expert_hidden_dim)
                                      for i in range(config.n_experts)})
        self.shared = FeedForward(config.dim, config.shared_hidden_dim) if config.shared_hidden_dim else None
        self.shared_gate = nn.Linear(config.dim, 1, bias=False) if config.moe_shared_gate else None
        self.register_buffer("expert_bias", torch.zeros(config.n_experts), persistent=False)
        self.dispatch = LocalDispatch()
        self.kernel = ExpertKernel()
        self.groups = RoutingGroups()
        self.loss_scale = 1.0  # gradient of the balancing loss: 1 / micro-batches per step (set by the trainer)
        self.stats = RoutingStats(config.n_experts)
        # Every rank holds the router and shared experts whole; under sequence parallelism the parallel
        # code makes this sum their gradient over the tensor-parallel ranks (each saw other tokens).
        self.replicated = _identity

    def local_experts(self) -> list[FeedForward]:
        """This rank's experts in ascending global index."""
        return [self.experts[k] for k in sorted(self.experts, key=int)]

    def route(self, x: torch.Tensor) -> tuple[Routing, torch.Tensor, torch.Tensor]:
        """(routing, fp32 logits, fp32 scores) of x (batch, seq, dim)."""
        batch, seq, _ = x.shape
        # the router runs in fp32 whatever the compute dtype (as Megatron-Core's fp32 router and DeepSeek-V3's gating
        # do): under bf16 autocast F.linear would cast these fp32 operands back to bf16, and close scores would tie
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.reshape(batch * seq, -1).float(), self.replicated(self.router.weight).float())
        scores = logits.softmax(-1) if self.config.moe_score == "softmax" else logits.sigmoid()
        with torch.no_grad():  # which experts: no gradient flows through the choice, so autograd keeps nothing of it
            select = scores + self.expert_bias  # zero unless balancing moves it (or a checkpoint brings one)
            if self.config.moe_groups > 1:
                select = limit_to_groups(select, self.config.moe_groups, self.config.moe_topk_groups)
            experts = select.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.config.moe_norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.config.moe_score == "sigmoid" else 0.0))
        weights = weights * self.config.moe_route_scale
        keep = None
        capacity = expert_capacity(self.config, seq * self.groups.sequence_ranks)
        if capacity:
            keep = capacity_mask(experts.view(batch, seq, -1), weights.view(batch, seq, -1).detach(),
                                 self.n_experts, capacity, self.config.moe_drop_policy).view(batch * seq, -1)
        return Routing(experts, weights, keep), logits, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(batch * seq, dim)
        routing, logits, scores = self.route(x)
        out = self.dispatch(flat, routing, self)
        if self.shared is not None:
            w = self.replicated
            s = self.shared
            shared = F.linear(F.silu(F.linear(flat, w(s.w1.weight))) * F.linear(flat, w(s.w3.weight)), w(s.w2.weight))
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(flat, w(self.shared_gate.weight))) * shared
            out = out + shared
        if torch.is_grad_enabled() and out.requires_grad:
            loss, record = self.balancing_loss(routing, logits, scores, batch, seq)
            out = _AttachLoss.apply(out, loss, self.loss_scale, self.stats, record)
        return out.view(batch, seq, dim)

    def balancing_loss(self, routing: Routing, logits: torch.Tensor, scores: torch.Tensor, batch: int, seq: int):
        """This rank's share of the balancing losses (fp32 scalar) and what the layer's statistics record."""
        c, E, k = self.config, self.n_experts, self.top_k
        g = self.groups
        load = expert_counts(routing.experts.reshape(-1), E).double()
        dropped = 0 if routing.keep is None else (~routing.keep).sum()
        loss = logits.new_zeros(())
        aux = z = 0.0
        if c.moe_aux_loss != "none":
            probs = scores if c.moe_score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
            if c.moe_aux_loss == "switch":
                counts = _all_reduce(load.clone(), g.tokens).float()
                tokens = batch * seq * g.token_ranks
                term = E * (counts / (tokens * k) * probs.sum(0) / tokens).sum()
            else:
                per_seq = F.one_hot(routing.experts.view(batch, seq * k), E).sum(1).float()  # (batch, E)
                counts = _all_reduce(per_seq, g.sequence)
                length = seq * g.sequence_ranks
                sequences = batch * (g.token_ranks // g.sequence_ranks)
                term = E * (counts / (length * k) * probs.view(batch, seq, E).sum(1) / length).sum() / sequences
            loss = loss + c.moe_aux_coeff * term
            aux = term.detach()
        if c.moe_z_loss_coeff:
            term = torch.logsumexp(logits, dim=-1).pow(2).sum() / (batch * seq * g.token_ranks)
            loss = loss + c.moe_z_loss_coeff * term
            z = term.detach()
        return loss, (load, dropped, routing.experts.numel(), aux, z)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: raise the bias of under-loaded experts, lower the over-loaded."""
        load = load.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.config.moe_bias_update_rate * torch.sign(load.mean() - load)
