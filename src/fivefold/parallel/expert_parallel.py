"""Expert parallelism: each MoE layer's experts split over `ep` ranks, tokens sent to them by all-to-all
(GShard, Lepikhin et al. 2020; Megatron-Core's MoE token dispatcher; DeepSpeed-MoE), and each expert's
weights optionally split over `etp` ranks (expert tensor parallelism, Megatron-Core's ETP).

Which ranks form the expert groups (Megatron-Core's "parallel folding": the experts' grid is laid over
the same ranks as attention's, factored differently). Within one pipeline stage, take the ranks that
hold *distinct tokens* of the step, in mesh order:
    tp 1, or tp > 1 with sequence parallelism:  data x context x tensor ranks (tp innermost)
    tp > 1 without sequence parallelism:        data x context ranks of one tensor-parallel rank
                                                (its peers hold the same tokens and the same experts)
and factor that fiber as EDP x EP x ETP, ETP innermost: consecutive runs of `etp` ranks are
expert-tensor-parallel groups (with sequence parallelism and etp = tp, the tensor-parallel group
itself); the ranks `etp` apart within a run of `ep x etp` form an expert-parallel group; the ranks at
the same place of every such run form an expert-data-parallel (EDP) group, over which the experts'
gradients are summed (DDP) or their states sharded (ZeRO). Attention and the dense layers keep their
data-parallel groups. With sequence parallelism an expert piece is therefore held by one rank of each
EDP group, never replicated over tensor-parallel ranks; the router and the shared experts, which every
rank holds whole, get their gradient summed over the tensor-parallel group like the norms.

One dispatch (`ExpertParallelDispatch`), per layer and micro-batch:
    1. route locally; sort the kept (token, choice) assignments by global expert
    2. all-to-all of the per-expert counts (E integers) over the EP group: every rank learns how many
       rows it gets from each peer for each of its experts, so the uneven splits are known both ways
    3. all-to-all of the rows (torch's all_to_all_single, or comm/alltoall.py's pairwise exchange)
    4. with etp > 1: the ETP peers swap their count tables and their received rows (an all-gather with
       uneven sizes), so each holds every row bound for the experts of its EP position
    5. regroup the rows by local expert and run the experts (ExpertKernel); with etp > 1 each rank holds
       1/etp of every expert's hidden units (w1, w3 by rows, w2 by columns, Megatron's column- then
       row-parallel MLP), so its output is a partial sum, and a reduce-scatter with uneven sizes over
       the ETP group adds the peers' partials and hands each rank its own rows back
    6. the reverse all-to-all brings each row home; the router's weights multiply it and the rows of
       one token are summed (the weights never leave the rank, so the router's gradient is local)
Backward runs the exchanges in reverse (the all-gather's backward is the reduce-scatter and back). A
rank with no tokens, an expert with none, or every token on one expert only changes the split sizes:
every rank still posts the same collectives, so nothing waits forever.

With load-aware placement (expert_placement.py, EPLB) a rank's slots may hold replicas of hot
experts: the dispatch spreads an expert's assignments over its replicas and `ReplicaGradients` sums
their gradients over the ranks holding them.

Worst-case rows one rank computes per layer and micro-batch: all ep x etp peers send it every token for
min(k, S) of its S expert slots (S = E/ep, plus EPLB's spare slots): ep x etp x T x min(k, S) rows of
`dim` values (T tokens per rank per micro-batch), and as many go back; `dispatch_bound_bytes` is that
formula, reported at start-up.
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
from fivefold.parallel.expert_placement import replica_holders
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


def _gather_rows(x: torch.Tensor, sizes: list[int], group, backend: str, meter: AllToAllMeter) -> torch.Tensor:
    """All-gather with uneven sizes over `group`: every peer's rows, peer by peer (`sizes[j]` from peer j).
    An all-to-all sending the same rows to every peer; its backward sums the peers' gradients of them."""
    n = x.shape[0]
    return _AllToAll.apply(x.repeat(len(sizes), *([1] * (x.dim() - 1))), sizes, [n] * len(sizes), group, backend,
                           meter)


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], me: int, group, backend: str,
                         meter: AllToAllMeter) -> torch.Tensor:
    """Reduce-scatter with uneven sizes: x holds partial sums of every peer's rows (peer by peer, `sizes`);
    returns the sum over the peers of this rank's rows. Backward: the gradient goes to every peer."""
    n = sizes[me]
    parts = _AllToAll.apply(x, [n] * len(sizes), sizes, group, backend, meter)
    return parts.view(len(sizes), n, *x.shape[1:]).sum(0)


class ExpertParallelDispatch:
    """The dispatch and combine of one MoE layer whose experts are placed on the ranks of `group` (EP)
    and whose every expert is split over the ranks of `etp_group` (ETP; None: held whole).

    `placement[r]` lists the experts rank r holds (its slots, ascending); an expert on several ranks
    is a replica set (expert_placement.py), and each rank spreads its assignments of such an expert
    over the replicas evenly. Without replicas rank r holds experts r*E/ep .. (r+1)*E/ep - 1.
    """

    def __init__(self, group: dist.ProcessGroup | None, ep_rank: int, placement: list[list[int]], n_experts: int,
                 backend: str, meter: AllToAllMeter, etp_group: dist.ProcessGroup | None = None):
        self.group, self.ep, self.ep_rank = group, len(placement), ep_rank
        self.etp_group = etp_group
        self.etp = dist.get_world_size(etp_group) if etp_group is not None else 1
        self.etp_rank = dist.get_rank(etp_group) if etp_group is not None else 0
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
        if self.ep > 1:
            received_counts = torch.empty_like(counts)
            with phase("expert count all-to-all", comm=True):
                dist.all_to_all_single(received_counts, counts, group=self.group)
        else:
            received_counts = counts
        sent = counts.view(self.ep, self.slots)
        got = received_counts.view(self.ep, self.slots)  # [source rank, local slot]
        in_splits, out_splits = sent.sum(1).tolist(), got.sum(1).tolist()
        rows = x.index_select(0, tokens)  # its backward an index_add, not index_put's slower accumulate
        if self.ep > 1:
            rows = _AllToAll.apply(rows, out_splits, in_splits, self.group, self.backend, self.meter)
        if self.etp > 1:  # every ETP peer's rows for this EP position's experts
            tables = [torch.empty_like(got) for _ in range(self.etp)]
            with phase("expert count all-gather", comm=True):
                dist.all_gather(tables, got, group=self.etp_group)
            got = torch.stack(tables).view(-1, self.slots)  # [(peer, source), local slot]
            peer_rows = [int(t.sum()) for t in tables]
            rows = _gather_rows(rows, peer_rows, self.etp_group, self.backend, self.meter)
        moe.stats.max_received = max(moe.stats.max_received, rows.shape[0])
        # received rows come source by source, each source's rows slot by slot: regroup by slot
        labels = torch.arange(self.slots, device=x.device).repeat(got.shape[0]).repeat_interleave(got.reshape(-1))
        regroup = torch.argsort(labels, stable=True)
        # each row buffer is dropped as soon as its copy exists, so that a layer's dispatch holds at most the rows
        # it sends and the rows it receives beyond what backward keeps (the planner's dispatch buffers)
        grouped = rows[regroup]
        del rows
        out = moe.kernel(grouped, got.sum(0).tolist(), moe.local_experts())
        del grouped
        back = out[torch.argsort(regroup)]
        del out
        if self.etp > 1:  # add the peers' partial sums; keep this rank's rows
            back = _reduce_scatter_rows(back, peer_rows, self.etp_rank, self.etp_group, self.backend, self.meter)
        if self.ep > 1:
            back = _AllToAll.apply(back, in_splits, out_splits, self.group, self.backend, self.meter)
        return combine(x, back, tokens, routing.weights.reshape(-1)[assignments])


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel, expert-tensor-parallel and expert-data-parallel groups."""

    ep: int
    ep_rank: int
    ep_group: dist.ProcessGroup | None
    edp_group: dist.ProcessGroup | None
    replicated_over_tp: bool  # tp > 1 without SP: tensor-parallel peers hold the same experts
    etp: int = 1
    etp_rank: int = 0
    etp_group: dist.ProcessGroup | None = None

    @property
    def active(self) -> bool:
        """Whether experts live off this rank (a dispatch with collectives runs)."""
        return self.ep > 1 or self.etp > 1


def expert_fiber(mesh, sequence_parallel: bool) -> list[list[int]]:
    """Rows of global ranks that hold distinct tokens of one pipeline stage (see the module docstring)."""
    grid = mesh.device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp)
    if sequence_parallel or mesh.dims.tp == 1:
        return grid.reshape(grid.shape[0], -1).tolist()
    return grid.permute(0, 4, 1, 2, 3).reshape(grid.shape[0] * grid.shape[4], -1).tolist()


def expert_rows(fibers: list[list[int]], ep: int, etp: int) -> dict[str, list[list[int]]]:
    """The rows of global ranks of every EP, ETP and EDP group: each fiber factored EDP x EP x ETP."""
    block = ep * etp
    return {
        "etp": [fiber[i : i + etp] for fiber in fibers for i in range(0, len(fiber), etp)],
        "ep": [fiber[b + j : b + block : etp] for fiber in fibers for b in range(0, len(fiber), block)
               for j in range(etp)],
        "edp": [fiber[i::block] for fiber in fibers for i in range(block)],
    }


def build_expert_groups(mesh, ep: int, sequence_parallel: bool, etp: int = 1) -> ExpertGroups:
    """Expert-parallel, expert-tensor-parallel and expert-data-parallel groups (collective: every rank creates
    every group)."""
    replicated = mesh.dims.tp > 1 and not sequence_parallel
    fibers = expert_fiber(mesh, sequence_parallel) if mesh.device_mesh is not None else [[0]]
    if len(fibers[0]) % (ep * etp):
        raise ConfigError(f"expert_parallel.degree x expert_parallel.tensor = {ep} x {etp} must divide the ranks holding "
                          "distinct tokens of one pipeline stage (data x context, x tensor with sequence parallelism) = "
                          f"{len(fibers[0])}: raise the data-parallel degree or lower the expert degrees")
    if mesh.device_mesh is None:
        return ExpertGroups(1, 0, None, None, False)
    rows = expert_rows(fibers, ep, etp)
    ep_group = mesh.subgroup(rows["ep"]) if ep > 1 else None
    etp_group = mesh.subgroup(rows["etp"]) if etp > 1 else None
    edp_group = mesh.subgroup(rows["edp"])
    me = dist.get_rank()
    ep_rank = next(row.index(me) for row in rows["ep"] if me in row)
    etp_rank = next(row.index(me) for row in rows["etp"] if me in row)
    return ExpertGroups(ep, ep_rank, ep_group, edp_group, replicated, etp, etp_rank, etp_group)


def token_fiber_size(dims, sequence_parallel: bool) -> int:
    """Ranks holding distinct tokens of one pipeline stage."""
    return dims.dp * dims.cp * (dims.tp if sequence_parallel else 1)


def check_expert_parallel(model: ModelConfig, ep: int, backend: str, dims_tokens: int | None = None,
                          etp: int = 1, zero_stage: int = 0) -> None:
    """The expert-parallel and expert-tensor-parallel degrees fit the model and the ranks (None: ranks not known yet),
    and ZeRO has an expert-data-parallel group to shard the experts over."""
    if backend not in ALLTOALL_BACKENDS:
        raise ConfigError(f"expert_parallel.alltoall = {backend!r}: one of {', '.join(ALLTOALL_BACKENDS)}")
    if model.n_experts and zero_stage and dims_tokens is not None and dims_tokens == ep * etp:
        raise ConfigError(f"data_parallel.zero_stage = {zero_stage} shards the experts over their expert-data-parallel "
                          f"group, but expert_parallel.degree x tensor = {ep} x {etp} leaves each expert piece on one "
                          "rank: lower the expert degrees or raise the data-parallel degree")
    if ep == 1 and etp == 1:
        return
    if model.n_experts == 0:
        setting = f"expert_parallel.degree = {ep}" if ep > 1 else f"expert_parallel.tensor = {etp}"
        raise ConfigError(f"{setting} splits the experts of mixture-of-experts layers, but the model has none: set "
                          "model.n_experts (or a MoE preset such as tiny-moe), or set it back to 1")
    if model.n_experts % ep:
        raise ConfigError(f"model.n_experts = {model.n_experts} is not divisible by expert_parallel.degree = {ep}: "
                          "each expert-parallel rank holds the same number of experts")
    if model.expert_hidden_dim % etp:
        raise ConfigError(f"the experts' hidden width (model.moe_ffn_dim) = {model.expert_hidden_dim} is not divisible by "
                          f"expert_parallel.tensor = {etp}: each expert-tensor-parallel rank holds an equal slice of it")
    if dims_tokens is not None and dims_tokens % (ep * etp):
        raise ConfigError(f"expert_parallel.degree x expert_parallel.tensor = {ep} x {etp} must divide the ranks holding "
                          "distinct tokens of one pipeline stage (data x context, x tensor with sequence parallelism) = "
                          f"{dims_tokens}: raise the data-parallel degree or lower the expert degrees")


def cut_experts(model: nn.Module, placements: dict[int, list[list[int]]], ep_rank: int) -> None:
    """Keep only this rank's experts (on the meta model, before any memory is allocated; names stay global)."""
    for module in model.modules():
        if isinstance(module, MoE):
            mine = set(placements[module.layer_id][ep_rank])
            for key in [k for k in module.experts if int(k) not in mine]:
                del module.experts[key]


@torch.no_grad()
def shard_experts(model: nn.Module, etp: int, etp_rank: int) -> None:
    """Keep this rank's 1/etp of every local expert's hidden units: w1 and w3 by rows, w2 by columns (after
    materialising, so the values are one process's). Each piece records its split (`TPSpec`) for checkpoints."""
    if etp == 1:
        return
    from fivefold.parallel.tensor_parallel import TPSpec, _parameter

    for module in model.modules():
        if isinstance(module, MoE):
            for expert in module.experts.values():
                hidden = expert.w1.out_features
                width = hidden // etp
                part = slice(etp_rank * width, (etp_rank + 1) * width)
                for linear, dim in ((expert.w1, 0), (expert.w3, 0), (expert.w2, 1)):
                    piece = linear.weight[part] if dim == 0 else linear.weight[:, part]
                    linear.weight = _parameter(piece, TPSpec(dim, tuple(range(etp)), hidden))
                expert.w1.out_features = expert.w3.out_features = expert.w2.in_features = width


def apply_expert_parallel(model: nn.Module, groups: ExpertGroups, placements: dict[int, list[list[int]]], backend: str,
                          meter: AllToAllMeter) -> None:
    for module in model.modules():
        if isinstance(module, MoE) and groups.active:
            module.dispatch = ExpertParallelDispatch(groups.ep_group, groups.ep_rank, placements[module.layer_id],
                                                     module.n_experts, backend, meter, groups.etp_group)


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
            holders = replica_holders(placements[layer])
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
            for p in params:  # back in place: a gradient that is a view of DDP's bucket stays one (no second copy)
                summed = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = summed
                else:
                    p.grad.copy_(summed)
                offset += p.numel()


def _ep_rows(mesh, groups: ExpertGroups) -> list[list[int]]:
    return expert_rows(expert_fiber(mesh, not groups.replicated_over_tp), groups.ep, groups.etp)["ep"]


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


def dispatch_bound_bytes(model: ModelConfig, tokens_per_rank: int, ep: int, bytes_per_value: int, replicas: int = 0,
                         etp: int = 1) -> int:
    """Worst-case bytes of rows one rank computes in one layer's dispatch (and sends back in the combine):
    ep x etp x T x min(k, slots per rank) rows, slots = E/ep (+ the replicas' spare slots)."""
    if not model.n_experts:
        return 0
    slots = model.n_experts // ep + replicas
    return ep * etp * tokens_per_rank * min(model.moe_top_k, slots) * model.dim * bytes_per_value


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
