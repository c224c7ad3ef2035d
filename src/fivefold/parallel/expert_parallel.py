"""Expert parallelism: each MoE layer's experts split over `ep` ranks, tokens sent to them by all-to-all
(GShard, Lepikhin et al. 2020; Megatron-Core's MoE token dispatcher; DeepSpeed-MoE).

Which ranks form an expert-parallel group (Megatron-Core's "parallel folding": the experts' grid is
laid over the same ranks as attention's, factored differently). Within one pipeline stage, take the
ranks that hold *distinct tokens* of the step, in mesh order:
    tp 1, or tp > 1 with sequence parallelism:  data x context x tensor ranks (tp innermost)
    tp > 1 without sequence parallelism:        data x context ranks of one tensor-parallel rank
                                                (its peers hold the same tokens and the same experts)
and cut that fiber into consecutive runs of `ep`: each run is an expert-parallel group, and the ranks
at the same place of every run form an expert-data-parallel (EDP) group, over which the experts'
gradients are summed (DDP) or their states sharded (ZeRO). Attention and the dense layers keep their
data-parallel groups. With sequence parallelism an expert is therefore held by one rank of each EDP
group, never replicated over tensor-parallel ranks; the router and the shared experts, which every
rank holds whole, get their gradient summed over the tensor-parallel group like the norms.

One dispatch (`ExpertParallelDispatch`), per layer and micro-batch:
    1. route locally; sort the kept (token, choice) assignments by global expert
    2. all-to-all of the per-expert counts (E integers): every rank learns how many rows it gets from
       each peer for each of its experts, so the token exchange's uneven splits are known both ways
    3. all-to-all of the rows (torch's all_to_all_single, or comm/alltoall.py's pairwise exchange)
    4. regroup the received rows by local expert, run the experts (ExpertKernel), undo the regrouping
    5. the reverse all-to-all brings each row home; the router's weights multiply it and the rows of
       one token are summed (the weights never leave the rank, so the router's gradient is local)
Backward runs the two exchanges in reverse. A rank with no tokens, an expert with none, or every token
on one expert only changes the split sizes: every rank still posts the same collectives, so nothing
waits forever.

With load-aware placement (expert_placement.py, EPLB) a rank's slots may hold replicas of hot
experts: the dispatch spreads an expert's assignments over its replicas and `ReplicaGradients` sums
their gradients over the ranks holding them.

Worst-case rows one rank receives per layer and micro-batch: all ep peers send it every token for
min(k, S) of its S expert slots (S = E/ep, plus EPLB's spare slots): ep x T x min(k, S) rows of `dim`
values (T tokens per rank per micro-batch), and as many go back; `dispatch_bound_bytes` is that formula, reported at start-up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fivefold.comm.alltoall import pairwise_all_to_all_v
from fivefold.comm.p2p import Ranks
from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.moe import MoE, Routing, RoutingGroups, combine
from fivefold.reliability.activity import phase

ALLTOALL_BACKENDS = ("torch", "pairwise")


@dataclass
class AllToAllMeter:
    """Time and bytes of this rank's token all-to-alls (both directions, forward and backward)."""

    seconds: float = 0.0
    bytes_sent: int = 0
    calls: int = 0

    def take(self) -> tuple[float, int, int]:
        out = (self.seconds, self.bytes_sent, self.calls)
        self.seconds, self.bytes_sent, self.calls = 0.0, 0, 0
        return out


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, backend: str,
              meter: AllToAllMeter) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    start = time.perf_counter()
    with phase("expert all-to-all", comm=True):
        if backend == "torch":
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        else:
            row = math.prod(x.shape[1:])
            flat_out = out.view(-1)
            pairwise_all_to_all_v(flat_out, x.contiguous().view(-1), [n * row for n in out_splits],
                                  [n * row for n in in_splits], Ranks.of_group(group))
    meter.seconds += time.perf_counter() - start
    me = dist.get_rank(group)
    meter.bytes_sent += (sum(in_splits) - in_splits[me]) * math.prod(x.shape[1:]) * x.element_size()
    meter.calls += 1
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to their expert's rank; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, backend, meter):
        ctx.args = (out_splits, in_splits, group, backend, meter)
        return _exchange(x, out_splits, in_splits, group, backend, meter)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, backend, meter = ctx.args
        return _exchange(grad, in_splits, out_splits, group, backend, meter), None, None, None, None, None


class ExpertParallelDispatch:
    """The all-to-all dispatch and combine of one MoE layer whose experts are placed on the ranks of `group`.

    `placement[r]` lists the experts rank r holds (its slots, ascending); an expert on several ranks
    is a replica set (expert_placement.py), and each rank spreads its assignments of such an expert
    over the replicas evenly. Without replicas rank r holds experts r*E/ep .. (r+1)*E/ep - 1.
    """

    def __init__(self, group: dist.ProcessGroup, ep_rank: int, placement: list[list[int]], n_experts: int,
                 backend: str, meter: AllToAllMeter):
        self.group, self.ep, self.ep_rank = group, len(placement), ep_rank
        self.backend, self.meter, self.placement = backend, meter, placement
        self.slots = len(placement[0])
        holders: list[list[int]] = [[] for _ in range(n_experts)]
        for r, experts in enumerate(placement):
            for j, e in enumerate(experts):
                holders[e].append(r * self.slots + j)
        width = max(len(h) for h in holders)
        self.replicas = torch.tensor([len(h) for h in holders])
        self.replica_slots = torch.tensor([h + [h[0]] * (width - len(h)) for h in holders])
        self.replicated = width > 1

    def physical_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot each assignment (sorted by expert) goes to: its expert's replica (k + rank) mod replicas."""
        if not self.replicated:
            return self.replica_slots[ids, 0].to(ids.device)
        counts = torch.bincount(ids, minlength=len(self.replicas))
        starts = counts.cumsum(0) - counts
        k = torch.arange(ids.numel(), device=ids.device) - starts[ids]
        choice = (k + self.ep_rank) % self.replicas.to(ids.device)[ids]
        return self.replica_slots.to(ids.device)[ids, choice]

    def __call__(self, x: torch.Tensor, routing: Routing, moe: MoE) -> torch.Tensor:
        assignments, ids = routing.sorted_assignments()
        slots = self.physical_slots(ids)
        if self.replicated:
            order = torch.argsort(slots, stable=True)
            assignments, slots = assignments[order], slots[order]
        k = routing.experts.shape[1]
        tokens = assignments // k
        counts = torch.bincount(slots, minlength=self.ep * self.slots)
        received_counts = torch.empty_like(counts)
        with phase("expert count all-to-all", comm=True):
            dist.all_to_all_single(received_counts, counts, group=self.group)
        sent = counts.view(self.ep, self.slots)
        got = received_counts.view(self.ep, self.slots)  # [source rank, local slot]
        in_splits, out_splits = sent.sum(1).tolist(), got.sum(1).tolist()
        rows = _AllToAll.apply(x[tokens], out_splits, in_splits, self.group, self.backend, self.meter)
        moe.stats.max_received = max(moe.stats.max_received, rows.shape[0])
        # received rows come source by source, each source's rows slot by slot: regroup by slot
        labels = torch.arange(self.slots, device=x.device).repeat(self.ep).repeat_interleave(got.reshape(-1))
        regroup = torch.argsort(labels, stable=True)
        out = moe.kernel(rows[regroup], got.sum(0).tolist(), moe.local_experts())
        back = out[torch.argsort(regroup)]
        returned = _AllToAll.apply(back, in_splits, out_splits, self.group, self.backend, self.meter)
        return combine(x, returned, tokens, routing.weights.reshape(-1)[assignments])


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel and expert-data-parallel groups, and what the norm needs to know."""

    ep: int
    ep_rank: int
    ep_group: dist.ProcessGroup | None
    edp_group: dist.ProcessGroup | None
    replicated_over_tp: bool  # tp > 1 without SP: tensor-parallel peers hold the same experts


def expert_fiber(mesh, sequence_parallel: bool) -> list[list[int]]:
    """Rows of global ranks that hold distinct tokens of one pipeline stage (see the module docstring)."""
    grid = mesh.device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp)
    if sequence_parallel or mesh.dims.tp == 1:
        return grid.reshape(grid.shape[0], -1).tolist()
    return grid.permute(0, 4, 1, 2, 3).reshape(grid.shape[0] * grid.shape[4], -1).tolist()


def build_expert_groups(mesh, ep: int, sequence_parallel: bool) -> ExpertGroups:
    """Expert-parallel and expert-data-parallel groups (collective: every rank creates every group)."""
    replicated = mesh.dims.tp > 1 and not sequence_parallel
    fibers = expert_fiber(mesh, sequence_parallel) if mesh.device_mesh is not None else [[0]]
    if len(fibers[0]) % ep:
        raise ConfigError(f"expert_parallel.degree = {ep} must divide the ranks holding distinct tokens of one pipeline "
                          f"stage (data x context, x tensor with sequence parallelism) = {len(fibers[0])}: raise the "
                          "data-parallel degree or lower expert_parallel.degree")
    if mesh.device_mesh is None:
        return ExpertGroups(1, 0, None, None, False)
    ep_rows = [fiber[i : i + ep] for fiber in fibers for i in range(0, len(fiber), ep)]
    edp_rows = [fiber[j::ep] for fiber in fibers for j in range(ep)]
    ep_group = mesh.subgroup(ep_rows) if ep > 1 else None
    edp_group = mesh.subgroup(edp_rows)
    me = dist.get_rank()
    ep_rank = next(row.index(me) for row in ep_rows if me in row)
    return ExpertGroups(ep, ep_rank, ep_group, edp_group, replicated)


def token_fiber_size(dims, sequence_parallel: bool) -> int:
    """Ranks holding distinct tokens of one pipeline stage."""
    return dims.dp * dims.cp * (dims.tp if sequence_parallel else 1)


def check_expert_parallel(model: ModelConfig, ep: int, backend: str, dims_tokens: int | None = None) -> None:
    """The expert-parallel degree fits the model and the ranks (None: ranks not known yet)."""
    if backend not in ALLTOALL_BACKENDS:
        raise ConfigError(f"expert_parallel.alltoall = {backend!r}: one of {', '.join(ALLTOALL_BACKENDS)}")
    if ep == 1:
        return
    if model.n_experts == 0:
        raise ConfigError(f"expert_parallel.degree = {ep} splits the experts of mixture-of-experts layers, but the model "
                          "has none: set model.n_experts (or a MoE preset such as tiny-moe), or expert_parallel.degree = 1")
    if model.n_experts % ep:
        raise ConfigError(f"model.n_experts = {model.n_experts} is not divisible by expert_parallel.degree = {ep}: "
                          "each expert-parallel rank holds the same number of experts")
    if dims_tokens is not None and dims_tokens % ep:
        raise ConfigError(f"expert_parallel.degree = {ep} must divide the ranks holding distinct tokens of one pipeline "
                          f"stage (data x context, x tensor with sequence parallelism) = {dims_tokens}: raise the data-"
                          "parallel degree or lower expert_parallel.degree")


def cut_experts(model: nn.Module, placements: dict[int, list[list[int]]], ep_rank: int) -> None:
    """Keep only this rank's experts (on the meta model, before any memory is allocated; names stay global)."""
    for module in model.modules():
        if isinstance(module, MoE):
            mine = set(placements[module.layer_id][ep_rank])
            for key in [k for k in module.experts if int(k) not in mine]:
                del module.experts[key]


def apply_expert_parallel(model: nn.Module, groups: ExpertGroups, placements: dict[int, list[list[int]]], backend: str,
                          meter: AllToAllMeter) -> None:
    for module in model.modules():
        if isinstance(module, MoE) and groups.ep > 1:
            module.dispatch = ExpertParallelDispatch(groups.ep_group, groups.ep_rank, placements[module.layer_id],
                                                     module.n_experts, backend, meter)


class ReplicaGradients:
    """Sums the gradients of replicated experts over the expert-parallel ranks holding them (after the
    expert-data-parallel reduction; sums commute), so every replica takes the same step."""

    def __init__(self, model: nn.Module, mesh, groups: ExpertGroups, placements: dict[int, list[list[int]]]):
        self.sets: list[tuple[list[nn.Parameter], dist.ProcessGroup]] = []
        self.counts: dict[int, int] = {}  # id(parameter) -> replicas (for the gradient norm)
        if groups.ep == 1:
            return
        ep_rows = _ep_rows(mesh, groups)
        created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        moes = {m.layer_id: m for m in model.modules() if isinstance(m, MoE)}
        for layer in sorted(placements):  # every rank walks every layer in one order: groups created alike
            holders: dict[int, list[int]] = {}
            for r, experts in enumerate(placements[layer]):
                for e in experts:
                    holders.setdefault(e, []).append(r)
            for e in sorted(holders):
                positions = tuple(holders[e])
                if len(positions) < 2:
                    continue
                if positions not in created:
                    created[positions] = mesh.subgroup([[row[p] for p in positions] for row in ep_rows])
                if layer in moes and groups.ep_rank in positions:
                    params = list(moes[layer].experts[str(e)].parameters())
                    self.sets.append((params, created[positions]))
                    self.counts.update({id(p): len(positions) for p in params})

    @torch.no_grad()
    def __call__(self) -> None:
        for params, group in self.sets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            with phase("replicated-expert all-reduce", comm=True):
                dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()


def _ep_rows(mesh, groups: ExpertGroups) -> list[list[int]]:
    fibers = expert_fiber(mesh, not groups.replicated_over_tp)
    return [fiber[i : i + groups.ep] for fiber in fibers for i in range(0, len(fiber), groups.ep)]


def apply_routing_groups(model: nn.Module, mesh, sequence_parallel: bool, kernel: str, loss_scale: float) -> None:
    """Tell every MoE layer which ranks share its routing statistics, its kernel and its loss's gradient scale."""
    from fivefold.model.moe import ExpertKernel

    dims = mesh.dims
    sp = sequence_parallel and dims.tp > 1
    token_ranks = dims.dp * dims.cp * (dims.tp if sp else 1)
    sequence_ranks = dims.cp * (dims.tp if sp else 1)
    tokens = mesh.group("dp_cp_tp" if sp else "dp_cp")
    sequence = mesh.group("cp_tp" if sp else "cp")
    for module in model.modules():
        if isinstance(module, MoE):
            module.groups = RoutingGroups(tokens, token_ranks, sequence, sequence_ranks)
            module.kernel = ExpertKernel(kernel)
            module.loss_scale = loss_scale


def is_expert_parameter(name: str) -> bool:
    return ".experts." in name


def dispatch_bound_bytes(model: ModelConfig, tokens_per_rank: int, ep: int, bytes_per_value: int, replicas: int = 0) -> int:
    """Worst-case bytes of rows one rank receives in one layer's dispatch (and sends back in the combine):
    ep x T x min(k, slots per rank) rows, slots = E/ep (+ the replicas' spare slots)."""
    if not model.n_experts:
        return 0
    slots = model.n_experts // ep + replicas
    return ep * tokens_per_rank * min(model.moe_top_k, slots) * model.dim * bytes_per_value


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
