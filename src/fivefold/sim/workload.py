"""One training step as every rank's program, built from the runtime's own objects.

Given a training config (the TOML `train` runs), a number of accelerators and a cluster file, this
module writes, for every global rank, the operations of one optimizer step on two streams, as
the runtime runs them:

    compute   the pipeline schedule's instruction stream (parallel/pipeline/schedules.py; one
              forward and one backward per micro-batch without a pipeline), posted the way the
              executor posts it: consecutive sends and receives go out together at the next
              compute pass, which waits for its receives; sends are waited for at reduce_grads.
              Each pass runs the stage's blocks in order (backward in reverse). A block's forward
              is its attention half and its MLP half, each closed by tensor parallelism's
              all-reduce (with sequence parallelism: opened by an all-gather, closed by a
              reduce-scatter); ring attention (context parallelism) passes K/V blocks around the
              cp ranks between steps of the attention core, Ulysses all-to-alls q/k/v and the
              output. Backward is twice the forward with the same collectives, full recomputation
              re-runs the forward first, selective recomputation the attention core.
    dp        the data-parallel communication thread: DDP's buckets (parallel/data_parallel.py
              `make_buckets`, over this rank's parameters in registration order) all-reduced as
              backward completes each one, in order; ZeRO's flat groups (parallel/flat_groups.py,
              one per block and weight-decay class) reduced as their block's backward ends
              (stage 1 all-reduces in the last micro-batch, stages 2-3 reduce-scatter in every
              one), ZeRO-3's per-block all-gathers before forward and backward with the runtime's
              one-block prefetch (on ranks sharing a CPU host's cores started once the block's pass is
              done, still ahead of its reduce-scatters). The optimizer step waits for all of it; ZeRO-1/2 then gather
              the updated weights, hybrid sharding all-reduces the shards over the replicas.
              Routed experts are a second instance over their expert-data-parallel group.

A MoE layer (parallel/expert_parallel.py) replaces its block's MLP half: the count and row
all-to-alls over the expert-parallel group, the expert-tensor-parallel gather and reduce-scatter,
the experts, the rows home, the routing statistics' all-reduce; backward the row exchanges in
reverse. Routing is balanced (every rank sends and receives k rows per token it holds) unless a
measured expert load is given (`expert_load`: each MoE layer's assignments per expert, as a run's
metrics.jsonl logs them and EPLB reads them): then every rank sends each expert-parallel rank the
load's share of its rows for the experts that rank holds, the row exchanges become uneven
all-to-alls of exactly those bytes per rank pair, and a rank's routed-expert compute grows with the
rows it receives.

Ranks are laid out as the mesh lays them out (parallel/mesh.py: pp, dp_replicate, dp_shard, cp,
tp, tp innermost). Compute seconds come from the planner (plan/estimate.py `pass_costs`: FLOPs at
the accelerator's peak times an achieved efficiency, plus memory traffic). Every collective
becomes the point-to-point messages of the runtime's algorithm (trace.py), or, on the analytical
fast path, one `Collective` op priced by comm/cost.py:

    flow        every collective as messages on the flow-level network
    hybrid      collectives inside one node (tensor parallelism, as a rule) analytical, the rest
                as messages: a node's switch is non-blocking, so contention lives between nodes
    aggregate   as hybrid, but a ring collective between nodes is one flow per rank to its ring
                successor carrying all its steps' bytes (the ring's steady state), plus the other
                steps' latencies: the fabric's sharing stays, the per-step rendezvous goes, and the
                events fall by 2(p - 1) per all-reduce: the flow-level path for a thousand GPUs
    analytical  every collective by formula, messages on a contention-free network, and only one
                rank per pipeline stage simulated (without contention the ranks of a stage are
                identical): the path for tens of thousands of accelerators

Gradient compression's codecs run each DDP bucket as their own exchanges (`compressed_reduce`,
comm/compression.py), after their local work on the bucket (`codec_work`, Accelerator.codec_seconds) on a
stream of its own, which a CPU host's shared cores run beside the ranks' compute.

Parameter servers (bsp) run as the runtime's pushes and pulls: each worker sends every server its
shard's gradients after backward and receives the new weights; each server waits for every push,
updates (the planner's seconds) and answers (`push_pull`, `server_program`).

EPLB's replicated experts (`expert_parallel.replicas`) fill every EP rank's spare slots as the runtime places them
(from `expert_parallel.load_from`); after DDP's reduction each replicated expert's gradient is all-reduced over
its holders (`replicated_experts`).

A tied embedding held by the first and the last pipeline stage has its two copies' gradients summed at
reduce_grads (gradient_sync.py `finish`): one all-reduce between the two ranks, before the communication
thread is waited for.

The step's scalar all-reduces (token count, gradient norm, the guard's verdict) run before the update,
each by formula (`scalars`).

The priority schedule (parallel/comm_schedule.py) cuts DDP's buckets into the runtime's slices; the
communication thread reduces them one by one (the readiness vector's all-reduce, then the slice's) in a
given order, each once its bucket is ready, and the step does not wait for them: from the second step
on, each unit's forward first waits for the previous step's slices holding its parameters and runs
AdamW on them. Its steady state is the second of two steps; sim/priority.py finds the order the
runtime's rule (the most urgent slice ready everywhere, whenever the thread is free) picks.

Asynchronous parameter servers (asp, ssp) run ASYNC_STEPS steps: each server steps once per push, in a given
order of the workers' pushes, and answers as the runtime's rule allows (`async_server_program`);
sim/asynchronous.py finds the arrival order and reads the workers' steady state off the run.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fivefold.comm.cost import best_all_reduce, native_collective, predict, ring_form, uneven_all_to_all
from fivefold.config.schema import JobConfig
from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.parallel.expert_placement import replica_holders
from fivefold.parallel.mesh import RANK_ORDERS
from fivefold.parallel.shard_layout import GROUP_KINDS
from fivefold.plan.cluster import ClusterSpec
from fivefold.plan.efficiency import Efficiency, as_efficiency
from fivefold.plan.estimate import (Degrees, PassCosts, codec_exchanges, compute_dtype, core_sharing, degrees_of, dispatch_rows, model_for,
                                    offload_seconds, pass_costs, priority_schedule, routing_report_values, server_loads,
                                    server_update_seconds,
                                    attention_all_reduces, scalar_groups, tied_embedding_bytes, tied_embedding_pair, weight_element,
                                    zero_degrees)
from fivefold.plan.expert_load import Matrix, exchange_matrices, expert_rows_by_load, imbalance
from fivefold.plan.parameters import (experts_per_rank, expert_values, flat_group_sizes, local_tensor, padded_vocab,
                                      powersgd_factors)
from fivefold.plan.zero_traffic import quantized_parts
from fivefold.sim.names import FIDELITIES
from fivefold.sim.routing import Router, cluster_router
from fivefold.sim.engine import SNAPSHOT, Await, Collective, Compute, Delay, Notify, Op, Recv, Send, StreamKey, Wait
from fivefold.sim.trace import collective_programs, resolve_algorithm, uneven_all_to_all_programs

COMPUTE, DP, CODEC = "compute", "dp", "codec"  # CODEC: a gradient codec's local work, for the DP stream
ASYNC_STEPS = 4  # steps simulated for asynchronous parameter servers (their steady state: sim/asynchronous.py)
_RING_FLOWS = ("all_reduce", "reduce_scatter", "all_gather")  # aggregate: the ring collectives played as flows


@dataclass(frozen=True)
class Grid:
    """Global ranks over (pp, dp_replicate, dp_shard, cp, tp), row-major, tp innermost, or with the pipeline inside
    data parallelism (`placement`: parallel/mesh.py RANK_ORDERS)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    placement: str = "outer"
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def order(self) -> tuple[str, ...]:
        """The dimensions from the slowest- to the fastest-changing along the global ranks."""
        return RANK_ORDERS[self.placement]

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for dim in reversed(self.order):
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return out

    def rank(self, **coords: int) -> int:
        rank = 0
        for dim in self.order:
            rank = rank * getattr(self, dim) + coords.get(dim, 0)
        return rank

    def stride(self, dim: str) -> int:
        """Ranks between neighbours along `dim` (the product of the sizes inside it)."""
        inner = 1
        for d in reversed(self.order):
            if d == dim:
                return inner
            inner *= getattr(self, d)
        raise KeyError(dim)

    def token_fibers(self, split_over_tp: bool) -> list[list[int]]:
        """Per pipeline stage, the ranks holding distinct tokens, in mesh order (parallel/expert_parallel.py
        `expert_fiber`): all of the stage's ranks when tp splits the tokens (or is 1), else one row per tp rank."""
        stages: list[list[int]] = [[] for _ in range(self.pp)]
        for rank in range(self.size):  # in rank order: a stage's ranks in mesh order under either placement
            stages[self.coords(rank)["pp"]].append(rank)
        if split_over_tp:
            return stages
        return [stage[t :: self.tp] for stage in stages for t in range(self.tp)]

    def group(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        """The ranks that differ from `rank` only in `dims` (a process group of the mesh), in rank order."""
        key = (rank, dims)
        if key not in self._groups:
            self._groups[key] = self._group(rank, dims)
        return self._groups[key]

    def _group(self, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
        coords = self.coords(rank)
        members = [rank - sum(coords[dim] * self.stride(dim) for dim in dims)]
        for dim in sorted(set(dims), key=self.order.index):  # outer dims first: the members come out in order
            stride = self.stride(dim)
            members = [m + i * stride for m in members for i in range(getattr(self, dim))]
        return tuple(members)


@dataclass(frozen=True)
class PrioritySlice:
    """One slice of the priority schedule: its DDP bucket, its bytes on the wire and its forward position (lower
    goes first)."""

    bucket: int
    nbytes: int
    priority: int


def first_guess_order(slices: list[PrioritySlice]) -> list[int]:
    """The communication thread's order if each bucket's slices were all reduced before the next bucket is ready:
    buckets as backward completes them, each one's slices most urgent first (sim/priority.py refines it)."""
    return sorted(range(len(slices)), key=lambda k: (slices[k].bucket, slices[k].priority, k))


@dataclass
class Unit:
    """A piece of a stage the runtime treats as one: a block, or the root (embedding; final norm and head)."""

    name: str
    index: int  # ZeRO unit index: the block's layer, or -1 for the root
    params: list[tuple[str, int]]  # (name, elements on this rank), in registration order: all but the routed experts
    moe: bool = False
    flat_groups: list[int] = field(default_factory=list)  # ZeRO's groups of this unit (elements on this rank, unpadded)
    experts: list[tuple[str, int]] = field(default_factory=list)  # this rank's routed experts' parameters (its EP slots)
    expert_groups: list[int] = field(default_factory=list)  # their flat groups (one per expert and weight-decay class)
    rows: dict[str, int] = field(default_factory=dict)  # a matrix's local first dimension (PowerSGD's factors)


@dataclass
class Workload:
    programs: dict[StreamKey, list[Op]]
    grid: Grid
    degrees: Degrees
    split: list[list[int]]
    simulated: tuple[int, ...]  # the ranks with programs (all, or one per pipeline stage on the analytical path)
    fidelity: str
    log: dict[int, list[tuple[str, tuple[int, ...], int, str, Matrix | None]]] = field(default_factory=dict)  # rank -> its calls
    expert_imbalance: float = 1.0  # under a measured expert load: the most rows an EP rank receives / the mean
    recorded: int = 0  # collectives expanded into messages (per step)
    analytical: int = 0  # collectives priced by formula (per step)
    expand: Callable[..., dict[int, list[Op]]] | None = field(default=None, repr=False)
    steps: int = 1  # optimizer steps the programs run (the priority schedule's steady state needs two)
    slices: list[PrioritySlice] = field(default_factory=list)  # the priority schedule's slices (else none)
    slice_order: list[int] = field(default_factory=list)  # the order its communication thread reduces them in
    unit_slices: dict[str, list[int]] = field(default_factory=dict)  # a unit -> the slices its next forward waits for
    server_ranks: tuple[int, ...] = ()  # asynchronous parameter servers' ranks (else none)
    push_orders: dict[int, list[int]] = field(default_factory=dict)  # each such server's order of the workers' pushes

    def calls(self, rank: int) -> list[tuple[str, tuple[int, ...], int]]:
        """`rank`'s torch.distributed calls, as sim/observe.py records the runtime's: (kind, group ranks, bytes)
        per backend collective, ("send", (rank, peer), bytes) per message, including every message of a
        hand-written algorithm (comm/, which posts them itself)."""
        out = []
        for kind, members, nbytes, algorithm, matrix in self.log.get(rank, []):
            if kind == "send" or algorithm == "native":
                out.append((kind, members, nbytes))
            else:
                program = self.expand(kind, algorithm, len(members), nbytes, matrix)[members.index(rank)]
                out += [("send", (rank, members[op.peer]), op.nbytes) for op in program if isinstance(op, Send)]
        return out


TIED_COPY = "tied-embedding"  # the last stage's unit holding its copy of a tied embedding


def stage_units(model: ModelConfig, split: list[list[int]], d: Degrees) -> list[list[Unit]]:
    """Every (virtual) stage's units in forward order, with each parameter's elements on one rank: the
    meta-device model's tensors, cut as tensor parallelism cuts them (attention and dense MLP weights
    and the vocabulary rows by tp), and its routed experts as expert parallelism cuts them (an expert-parallel
    rank's E/ep experts, each expert's hidden units by etp; every rank's slots are the same size). ZeRO's flat
    groups are the runtime's own (plan/parameters.py `flat_group_sizes`, the planner's: per block and weight-decay
    class, one per routed expert; the root's per top-level module). A tied embedding whose last stage lies on another rank
    than the first is a unit of both: the embedding, and on the last stage its copy (`TIED_COPY`) for the head."""
    from fivefold.model import build_model
    from fivefold.parallel.expert_parallel import cut_experts

    net = build_model(model)  # meta device: shapes only
    if model.n_experts and d.ep > 1:  # every rank holds as many slots (E / ep, plus EPLB's spares) of one size
        slots = experts_per_rank(model, d.ep, d.replicas)
        cut_experts(net, {layer: [list(range(slots))] for layer in model.moe_layers}, 0)
    rows: dict[str, int] = {}
    vocab = padded_vocab(model.vocab_size, d.tp)
    by_unit: dict[str, list[tuple[str, int]]] = defaultdict(list)
    experts: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        numel, rows[name] = local_tensor(name, tuple(p.shape), vocab, d.tp, d.etp, model.head_size)
        expert = ".experts." in name
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name.split(".")[0]
        (experts if expert else by_unit)[unit].append((name, numel))
    sizes = flat_group_sizes(model, d.tp, d.etp, d.ep, d.replicas)
    names = ["embedding", "head", *(f"layers.{i}" for i in range(model.n_layers))]
    groups = {name: list(sizes.unit(name)[0]) for name in names}
    expert_groups = {name: list(sizes.unit(name)[1]) for name in names}
    stages = []
    tied_copy = bool(tied_embedding_pair(model, d, split, tuple(range(d.pp))))  # first and last stage on two ranks
    for s, layers in enumerate(split):
        units = []
        if s == 0:
            units.append(Unit("embedding", -1, by_unit["tok_embeddings"], flat_groups=groups["embedding"], rows=rows))
        units += [Unit(f"layers.{i}", i, by_unit[f"layers.{i}"], model.is_moe_layer(i), groups[f"layers.{i}"],
                       experts[f"layers.{i}"], expert_groups[f"layers.{i}"], rows) for i in layers]
        if s == len(split) - 1:
            if tied_copy:  # the last stage's copy of the tied embedding, its gradient complete once the head's is
                units.append(Unit(TIED_COPY, -1, by_unit["tok_embeddings"], flat_groups=groups["embedding"], rows=rows))
            units.append(Unit("head", -1, by_unit["norm"] + by_unit["output"], flat_groups=groups["head"], rows=rows))
        stages.append(units)
    return stages


@dataclass
class _DdpPart:
    """One DataParallel instance of the runtime: the dense weights' over dp x cp, or the routed experts' over
    their expert-data-parallel group."""

    group: tuple[int, ...]
    buckets: list[int] = field(default_factory=list)  # bytes of each bucket, in order
    contents: list[list[tuple[int, int]]] = field(default_factory=list)  # each bucket's tensors: (elements, rows)
    bucket_of: dict[tuple[int, str], list[int]] = field(default_factory=lambda: defaultdict(list))  # (stage, unit) ->
    # the buckets its backward completes
    slices: list[PrioritySlice] = field(default_factory=list)  # the priority schedule's (comm_schedule.py plan_slices)
    unit_slices: dict[tuple[int, str], list[int]] = field(default_factory=dict)  # (stage, unit) -> the slices its
    # parameters lie in: what its next forward waits for


@dataclass
class _ZeroPart:
    """One ZeroDataParallel instance of the runtime: the dense weights' (any shard degrees, ZeRO++), or the routed
    experts' (plain ZeRO over their expert-data-parallel group)."""

    degrees: object  # parallel/shard_layout.py ShardDegrees
    groups: dict[str, tuple[int, ...]]  # kind (GROUP_KINDS) -> global ranks
    flat: dict[tuple[int, str], list[int]]  # (stage, unit) -> its flat groups' elements, padded
    dense: bool


class _Builder:
    def __init__(self, config: JobConfig, gpus: int, cluster: ClusterSpec, efficiency: float | Efficiency,
                 fidelity: str, vocab_size: int, router: Router | None = None,
                 expert_load: dict[str, list] | None = None, slice_order: list[int] | None = None,
                 steps: int = 0, push_orders: dict[int, list[int]] | None = None):
        from fivefold.parallel.pipeline.stages import plan_stages

        if fidelity not in FIDELITIES:
            raise ConfigError(f"--fidelity {fidelity!r}: use one of {', '.join(FIDELITIES)}")
        efficiency = as_efficiency(efficiency)
        cluster.check_size(gpus)
        self.config, self.cluster, self.fidelity = config, cluster, fidelity
        self.d = d = degrees_of(config, gpus)
        _refuse_unmodelled(config, d)
        if config.data_parallel.mode == "ps" and fidelity == "analytical":
            raise ConfigError("data_parallel.mode = ps with --fidelity analytical: every worker's push meets the others "
                              "at its server's link, which the contention-free path does not share; use --fidelity "
                              "flow or hybrid")
        self.model = model_for(config, vocab_size)
        t, pipe = config.train, config.pipeline_parallel
        self.split = plan_stages(self.model, t.seq_len, d.pp * pipe.virtual, pipe.layers_per_stage, pipe.balance) \
            if d.pp > 1 else [list(range(self.model.n_layers))]
        self.grid = Grid(d.pp, d.dp // d.dp_shard, d.dp_shard, d.cp, d.tp, d.placement)
        self.costs: PassCosts = pass_costs(config, self.model, d, cluster, efficiency)
        self.units = stage_units(self.model, self.split, d)
        self.element = 2 if compute_dtype(config) == "bf16" else 4
        self.sp = config.tensor_parallel.sequence_parallel and d.tp > 1
        self.tp_overlap = self.sp and config.tensor_parallel.comm_overlap
        self.activation = t.micro_batch_size * (t.seq_len // d.cp) * self.model.dim * self.element
        self.per_node = cluster.accelerators_per_node
        # ranks sharing one CPU host's cores: a collective's transfers need the cores the compute holds
        self.shared_host = core_sharing(config, d, cluster) is not None
        self.weight_element = weight_element(config)
        self.attention_calls = attention_all_reduces(config, self.model, d)  # (forward, backward) bytes per block
        self.reduce_element = 2 if config.gradient_comm.reduce_dtype == "bf16" else self.weight_element
        self.zero_node = config.gradient_comm.node_size or cluster.accelerators_per_node  # ZeRO++'s nodes
        self.expert_groups: dict[str, dict[int, tuple[int, ...]]] = {}  # "ep" / "etp" / "edp" -> rank -> its group
        if self.model.n_experts:
            from fivefold.parallel.expert_parallel import expert_rows

            fibers = self.grid.token_fibers(self.sp or d.tp == 1)
            for kind, rows in expert_rows(fibers, d.ep, d.etp).items():
                self.expert_groups[kind] = {r: tuple(row) for row in rows for r in row}
            self.dispatch_bytes = dispatch_rows(self.model, config, d) * self.model.dim * self.element
            self.alltoall = "pairwise" if config.expert_parallel.alltoall == "pairwise" else "native"
        self.placements = {}  # EPLB: every MoE layer's experts per EP rank, as the runtime places them
        if d.replicas and d.ep > 1:
            from fivefold.parallel.expert_placement import placements_for

            ep = config.expert_parallel
            self.placements = placements_for(self.model.moe_layers, self.model.n_experts, d.ep, d.replicas, ep.load_from)
            self.expert_bytes = expert_values(self.model, d.etp)  # one expert's values on this rank
        self.expert_rows = expert_rows_by_load(self.model, config, d, expert_load) if expert_load is not None else {}
        # parameter servers (bsp): the last ranks, after the workers' grid (parallel/parameter_server.py)
        self.ps = config.data_parallel.mode == "ps"
        self.server_ranks = tuple(range(d.dp, d.dp + config.parameter_server.servers)) if self.ps else ()
        self.loads = server_loads(self.model, config.parameter_server.servers, d.dp) if self.ps else []
        if fidelity == "analytical" and not self.ps:
            firsts = [self.grid.rank(pp=p) for p in range(d.pp)]
            # under a measured expert load the EP ranks compute different rows and wait for each other: the whole
            # expert-parallel group of each stage's first rank is simulated (the busiest among them)
            self.simulated = tuple(sorted({r for first in firsts for r in self.expert_groups["ep"][first]})) \
                if self.expert_rows else tuple(firsts)
        else:
            self.simulated = tuple(range(self.grid.size)) + self.server_ranks
        self._simulated = set(self.simulated)
        self.programs: dict[StreamKey, list[Op]] = defaultdict(list)
        self._handles: dict[StreamKey, int] = defaultdict(int)
        self._sequence: dict[tuple, int] = defaultdict(int)
        self._recordings: dict[tuple, dict[int, list[Op]]] = {}
        self._formulas: dict[tuple, float] = {}  # collective seconds by formula, per (kind, algorithm, bytes, p, span)
        self._simulated_members: dict[tuple[int, ...], int] = {}  # a group -> how many of it are simulated
        self._computes: dict[tuple[float, str], Compute] = {}  # equal compute ops, shared (they are immutable)
        self._skewed = cluster.arrival.measured  # blocking collectives wait for the ranks' arrival skew
        # the op every member of a collective priced by formula posts for one call, shared until the last of its
        # simulated members has taken it
        self._posted: dict[tuple, list] = {}
        self._ring_latency: dict[tuple[int, ...], float] = {}  # aggregate: a ring's slowest hop latency
        self.router = (router or cluster_router(cluster, gpus)) if fidelity == "aggregate" else None
        self._events: dict[int, int] = defaultdict(int)
        self._since: dict[int, float] = defaultdict(float)  # compute seconds since the rank's last sync point
        self.recorded = self.analytical = 0
        self.log: dict[int, list[tuple[str, tuple[int, ...], int, str, Matrix | None]]] = defaultdict(list)
        # the priority schedule (parallel/comm_schedule.py): its steady state is the second of two steps (the first
        # step's gradients are reduced under the second's forward); slice_order: the communication thread's order
        self.priority = priority_schedule(config, d)
        # asynchronous parameter servers (asp, ssp): no two steps alike until the workers settle into their
        # rhythm around the servers; ASYNC_STEPS steps, sim/asynchronous.py reads the steady state off them;
        # push_orders: each server's order of the workers' pushes
        self.async_ps = self.ps and config.parameter_server.sync != "bsp"
        self.steps = steps or (2 if self.priority else ASYNC_STEPS if self.async_ps else 1)
        self.step = 0
        self.slice_order = slice_order
        turns = [w for _ in range(self.steps) for w in range(d.dp)]  # default: the workers in turn, step by step
        self.push_orders = {server: list((push_orders or {}).get(server) or turns)
                            for server in self.server_ranks} if self.async_ps else {}

    def expert_imbalance(self) -> float:
        """The most rows one expert-parallel rank receives over the mean, over the MoE layers (1: balanced)."""
        return imbalance(self.expert_rows)

    # ------------------------------------------------------------------ primitives
    def _handle(self, key: StreamKey) -> int:
        self._handles[key] += 1
        return self._handles[key] - 1

    def _event(self, rank: int, prefix: str) -> str:
        self._events[rank] += 1
        return f"{prefix}{self._events[rank]}"

    def _inside_node(self, members: tuple[int, ...]) -> bool:
        return members[0] // self.per_node == members[-1] // self.per_node

    def collective(self, rank: int, stream: str, kind: str, members: tuple[int, ...], nbytes: int, label: str,
                   algorithm: str = "native", matrix: Matrix | None = None, by_formula: bool = False) -> None:
        """Append `rank`'s part of one collective over `members` (nbytes: a rank's whole vector; an uneven
        all-to-all gives `matrix`, the bytes of every pair of members, and nbytes is what this rank sends);
        by_formula: one `Collective` op priced by comm/cost.py whatever the fidelity."""
        p = len(members)
        if p == 1 or nbytes <= 0:
            return
        if stream == COMPUTE:
            self.arrive(rank, label, p)
        key = (rank, stream)
        ops = self.programs[key]
        sequence_key = (stream, members, rank)
        sequence = self._sequence[sequence_key] = self._sequence[sequence_key] + 1
        self.log[rank].append((kind, members, nbytes, algorithm, matrix))
        if by_formula or self.fidelity == "analytical" or (self.fidelity != "flow" and self._inside_node(members)):
            ops.append(self._posted_collective(stream, kind, algorithm, members, nbytes, matrix, sequence, label))
            self.analytical += rank == members[0] and not by_formula  # the fidelity's choice, not a scalar's
            return
        if self.fidelity == "aggregate" and kind in _RING_FLOWS and resolve_algorithm(kind, algorithm) == "ring":
            self._ring_flow(rank, stream, kind, members, nbytes, label)
            return
        offset = self._handles[key]
        top = offset
        for op in self._recording(kind, algorithm, p, nbytes, matrix)[members.index(rank)]:
            if isinstance(op, Send):
                ops.append(Send(members[op.peer], op.nbytes, op.handle + offset))
                top = max(top, op.handle + offset + 1)
            elif isinstance(op, Recv):
                ops.append(Recv(members[op.peer], op.nbytes, op.handle + offset))
                top = max(top, op.handle + offset + 1)
            elif isinstance(op, Wait):
                ops.append(Wait(tuple(h + offset for h in op.handles), label))
        self._handles[key] = top
        self.recorded += rank == members[0]

    def _posted_collective(self, stream: str, kind: str, algorithm: str, members: tuple[int, ...], nbytes: int,
                           matrix: Matrix | None, sequence: int, label: str) -> Collective:
        """The `Collective` op of one call priced by formula. Every member posts an equal op, so the first to post
        builds it and the others take the same object (a step at 1,024 ranks posts millions)."""
        key = (stream, members, sequence, label, kind, algorithm, nbytes, matrix)
        posted = self._posted.get(key)
        if posted is None:
            span = members[-1] - members[0] + 1
            seconds = self._formula(kind, algorithm, nbytes, len(members), span) if matrix is None else \
                self._uneven_formula(matrix, span)
            if members not in self._simulated_members:
                self._simulated_members[members] = sum(m in self._simulated for m in members)
            size = self._simulated_members[members]
            posted = self._posted[key] = [Collective((stream, members, sequence), size, seconds, label), size]
        posted[1] -= 1
        if posted[1] <= 0:
            del self._posted[key]
        return posted[0]

    def _ring_flow(self, rank: int, stream: str, kind: str, members: tuple[int, ...], nbytes: int,
                   label: str) -> None:
        """A ring collective as one flow per rank to its successor, carrying all its steps' bytes (the ring's
        steady state), plus the other steps' latencies: contention for the fabric stays, the per-step
        rendezvous goes. Uncontended, this is the ring formula exactly."""
        key, p = (rank, stream), len(members)
        steps, volume = ring_form(kind, p)
        position = members.index(rank)
        if members not in self._ring_latency:  # a ring step lasts as long as its slowest hop's latency
            self._ring_latency[members] = max(
                self.router.path_latency(self.router.route(a, b, None)) for a, b in zip(members, members[1:] + members[:1]))
        extra = (steps - 1) * self._ring_latency[members]
        ops = self.programs[key]
        if extra > 0:
            ops.append(Compute(extra, label))
        send = Send(members[(position + 1) % p], round(volume * nbytes), self._handle(key))
        recv = Recv(members[(position - 1) % p], round(volume * nbytes), self._handle(key))
        ops += [send, recv, Wait((send.handle, recv.handle), label)]
        self.recorded += rank == members[0]

    def _formula(self, kind: str, algorithm: str, nbytes: int, p: int, span: int) -> float:
        """Seconds of one collective by the cost model (comm/cost.py), over ranks within `span` consecutive ones."""
        key = (kind, algorithm, nbytes, p, span)
        if key not in self._formulas:
            if algorithm in ("native", "ring") or kind != "all_reduce":
                seconds = native_collective(kind, nbytes, p, self.cluster.collective_link(kind, span))
            else:
                links = dataclasses.replace(self.cluster.links(), node_size=self._node_size(p))
                seconds = predict(algorithm, nbytes, p, links)
            self._formulas[key] = seconds
        return self._formulas[key]

    def _uneven_formula(self, matrix: Matrix, span: int) -> float:
        """Seconds of an uneven all-to-all by the cost model (comm/cost.py `uneven_all_to_all`)."""
        key = ("uneven", matrix, span)
        if key not in self._formulas:
            self._formulas[key] = uneven_all_to_all(matrix, self.cluster.collective_link("all_to_all", span))
        return self._formulas[key]

    def _recording(self, kind: str, algorithm: str, p: int, nbytes: int,
                   matrix: Matrix | None = None) -> dict[int, list[Op]]:
        """The runtime algorithm's programs over positions 0..p-1 (recorded once per shape and size; an uneven
        all-to-all, whatever `algorithm`, as the runtime's pairwise exchange of `matrix`)."""
        if matrix is not None:
            if ("uneven", matrix) not in self._recordings:
                self._recordings[("uneven", matrix)] = uneven_all_to_all_programs(matrix)
            return self._recordings[("uneven", matrix)]
        algorithm = resolve_algorithm(kind, algorithm)
        cache = (kind, algorithm, p, nbytes, self._node_size(p))
        if cache not in self._recordings:
            self._recordings[cache] = collective_programs(kind, algorithm, tuple(range(p)), nbytes,
                                                          node_size=cache[-1])
        return self._recordings[cache]

    def _node_size(self, p: int) -> int:
        g = self.config.gradient_comm
        return g.node_size or min(p, self.per_node)

    def exchange(self, rank: int, peers: tuple[int, int], nbytes: int, label: str, span: int) -> list[int | str]:
        """Post a send to the next and a receive from the previous ring neighbour (one batch_isend_irecv);
        returns what to wait on. With the neighbours off the simulated ranks (the analytical path) the
        transfer is its alpha-beta time on a stream of its own, so it still overlaps the compute, on the link
        the ring's `span` consecutive ranks cross (a ring moves at its slowest hop's pace; the planner's). Posting
        takes the rank's own thread the accelerator's `post_seconds` first (gloo on a CPU; 0 on GPUs)."""
        key = (rank, COMPUTE)
        self.log[rank].append(("send", (rank, peers[0]), nbytes, "", None))
        posting = self.cluster.accelerator.post_seconds(nbytes)
        if posting > 0:  # not compute since the last sync point (the planner's skew counts the passes' compute)
            self.programs[key].append(Compute(posting, label))
        if peers[0] in self._simulated and peers[1] in self._simulated:
            send, recv = Send(peers[0], nbytes, self._handle(key)), Recv(peers[1], nbytes, self._handle(key))
            self.programs[key] += [send, recv]
            return [send.handle, recv.handle]
        start, done = self._event(rank, "post"), self._event(rank, "arrived")
        link = self.cluster.link_for(span)
        self.programs[key].append(Notify(start))
        # one transfer stream per destination: messages to one peer go in turn, to different peers side by side
        self.programs[(rank, f"p2p{peers[0]}")] += [Await(start, "idle"), Compute(link.message(nbytes), label),
                                                     Notify(done)]
        return [done]

    def arrive(self, rank: int, label: str, ranks: int) -> None:
        """`rank` reaches a sync point of `ranks` ranks: inside a block pass (label tp, cp or ep) it first waits
        for the others' arrival skew after the compute since its last sync point (ClusterSpec.sync_delay,
        the planner's plan/estimate.py `block_sync_waits` rule); every sync point restarts the count."""
        if self._skewed and label in ("tp", "cp", "ep") and ranks > 1:
            delay = self.cluster.sync_delay(self._since[rank], ranks)
            if delay > 0:
                self.programs[(rank, COMPUTE)].append(Delay(delay, label))
        self._since[rank] = 0.0

    def wait(self, rank: int, handles: list[int | str], label: str, ranks: int = 0) -> None:
        """Wait for message handles (ints) and for the transfers of the analytical path (event names); with
        `ranks`, a block pass's sync point among that many ranks (`arrive`)."""
        if handles:
            self.arrive(rank, label if ranks else "", ranks)
        ints = tuple(h for h in handles if isinstance(h, int))
        if ints:
            self.programs[(rank, COMPUTE)].append(Wait(ints, label))
        self.programs[(rank, COMPUTE)] += [Await(h, label) for h in handles if isinstance(h, str)]

    def compute(self, rank: int, seconds: float, label: str) -> None:
        if seconds > 0:
            op = self._computes.get((seconds, label))
            if op is None:  # ops are immutable: every rank's equal passes share one (a few dozen distinct in a step)
                op = self._computes[(seconds, label)] = Compute(seconds, label)
            self.programs[(rank, COMPUTE)].append(op)
            self._since[rank] += seconds

    # ------------------------------------------------------------------ one block
    def block_pass(self, rank: int, unit: Unit, backward: bool, recompute: bool = False) -> None:
        """A block's forward (or its backward, or the forward recomputed before it): attention half, MLP half."""
        forward = self.costs.block[unit.moe]
        core = self.costs.core
        scale = 2.0 if backward else 1.0
        label = "recompute" if recompute else ("backward" if backward else "forward")
        halves = ("mlp", "attention") if backward else ("attention", "mlp")
        for half in halves:
            if half == "mlp" and unit.moe:  # outside the tensor-parallel region (parallel/tensor_parallel.py)
                self.experts(rank, forward / 2 * scale, label, backward, unit.index, scale)
                if backward:
                    self.norm_gradient(rank)
                continue
            if self.tp_overlap:
                self.overlapped_half(rank, half, forward, core, scale, label, backward)
                continue
            if half == "attention":
                self.attention(rank, (forward / 2 - core) * scale, core * scale, label, backward)
            else:
                self.compute(rank, forward / 2 * scale, label)
            self.tensor_parallel(rank)
            if backward:
                self.norm_gradient(rank)

    def experts(self, rank: int, seconds: float, label: str, backward: bool, layer: int, scale: float) -> None:
        """A MoE layer as parallel/expert_parallel.py runs it: route; all-to-all the per-expert counts and then the
        rows over the EP group; with etp > 1 all-gather the count tables and the rows over the ETP group; the
        experts (`seconds`, with the router and shared experts); the ETP reduce-scatter and the all-to-all home.
        Each of those row exchanges is an all_to_all_single call (the ETP gather and reduce-scatter send etp x the
        rows). Backward runs the row exchanges in reverse, then, under sequence parallelism, sums the router's and
        shared experts' weight gradients over the tensor-parallel group. The routing statistics of the balancing
        loss are all-reduced over the ranks sharing the micro-batch (or the sequence) in a forward that keeps
        the graph (with full recomputation only its re-run does). Balanced routing: every rank sends and
        receives k tokens' rows (fewer if the capacity factor drops some). Under a measured load
        (`expert_rows`, the same for or different from rank to rank) the row exchanges are uneven: each rank
        sends every EP rank the rows bound for its experts and gets its own rows back the same way, and the
        routed experts' compute (`scale` x `costs.routed` at balanced routing) follows the rows this rank
        receives."""
        ep, etp = self.expert_groups["ep"][rank], self.expert_groups["etp"][rank]
        rows, counts = self.dispatch_bytes, 8 * self.model.n_experts  # int64 per (EP rank, slot)
        a2a = self.alltoall
        out = home = None  # uneven: [i][j] the bytes EP rank i sends EP rank j, to the experts and back home
        there = received = rows  # the bytes this rank sends to the experts, and receives (and sends back)
        if layer in self.expert_rows and rows:
            out, home = exchange_matrices(self.expert_rows[layer], self.model.dim * self.element)
            me = ep.index(rank)
            there, received = sum(out[me]), sum(source[me] for source in out)
            seconds += scale * self.costs.routed * (received / rows - 1)
        gathered = received * len(etp)
        if not backward:
            self.collective(rank, COMPUTE, "all_to_all", ep, counts, "ep")
        self.collective(rank, COMPUTE, "all_to_all", ep, there, "ep", a2a, out)
        if not backward:
            self.collective(rank, COMPUTE, "all_gather", etp, counts * len(etp), "ep")
        self.collective(rank, COMPUTE, "all_to_all", etp, gathered, "ep", a2a)
        self.compute(rank, seconds, label)
        self.collective(rank, COMPUTE, "all_to_all", etp, gathered, "ep", a2a)
        self.collective(rank, COMPUTE, "all_to_all", ep, received, "ep", a2a, home)
        if not backward:
            if self.model.moe_aux_loss != "none" and (label == "recompute" or self.config.train.recompute != "full"):
                self.routing_statistics(rank)
            return
        if self.sp:  # _ReplicaGradSum: one all-reduce per replicated weight
            m, group = self.model, self.grid.group(rank, ("tp",))
            shared = [m.shared_hidden_dim * m.dim] * 3 if m.shared_hidden_dim else []
            for numel in shared + ([m.dim] if m.shared_hidden_dim and m.moe_shared_gate else []) + [m.n_experts * m.dim]:
                self.collective(rank, COMPUTE, "all_reduce", group, numel * self.weight_element, "tp")

    def routing_statistics(self, rank: int) -> None:
        """model/moe.py balancing_loss: the switch loss all-reduces the layer's expert counts (E float64) over the
        micro-batch's ranks, the sequence loss each sequence's counts (b x E float32) over the sequence's."""
        m, t = self.model, self.config.train
        split = ("tp",) if self.sp else ()
        if m.moe_aux_loss == "switch":
            group = self.token_group(rank)
            self.collective(rank, COMPUTE, "all_reduce", group, 8 * m.n_experts, "ep")
        else:
            group = self.grid.group(rank, ("cp",) + split)
            self.collective(rank, COMPUTE, "all_reduce", group, 4 * t.micro_batch_size * m.n_experts, "ep")

    def token_group(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the distinct tokens of `rank`'s micro-batch (RoutingGroups.tokens)."""
        return self.grid.group(rank, ("dp_replicate", "dp_shard", "cp") + (("tp",) if self.sp else ()))

    def routing_report(self, rank: int) -> None:
        """train/routing_report.py: after the step, the stage's MoE layers' loads, counts and loads by EP position
        (`routing_report_values` float64 each) in one all-reduce over the ranks holding its distinct tokens."""
        stages = range(self.grid.coords(rank)["pp"], len(self.split), self.d.pp)
        layers = sum(unit.moe for s in stages for unit in self.units[s])
        if layers:
            values = routing_report_values(self.config, self.model, self.d)
            self.collective(rank, COMPUTE, "all_reduce", self.token_group(rank), layers * values * 8, "ep")

    def overlapped_half(self, rank: int, half: str, forward: float, core: float, scale: float, label: str,
                        backward: bool) -> None:
        """tensor_parallel.comm_overlap (parallel/tp_overlap.py): the region's entry ring runs beside the matmuls
        that read the gathered input (q, k, v or w1, w3), its exit ring beside the row-parallel one (wo or w2),
        each chunk's transfer beside one chunk's matmul; shares of the half's matmul seconds by their weights."""
        m = self.model
        if half == "attention":
            entry, exit_ = m.q_dim + 2 * m.kv_dim, m.q_dim
            matmul = (forward / 2 - core) * scale
        else:
            entry, exit_ = 2, 1
            matmul = forward / 2 * scale
        first, last = entry / (entry + exit_), exit_ / (entry + exit_)
        if backward:
            first, last = last, first  # the exit's conjugate comes first in backward
        self.tp_ring(rank, matmul * first, label)
        if half == "attention":
            self.attention(rank, 0.0, core * scale, label, backward)
        self.tp_ring(rank, matmul * last, label)
        if backward:
            self.norm_gradient(rank)

    def tp_ring(self, rank: int, seconds: float, label: str) -> None:
        """One collective matmul: t - 1 ring exchanges of a sequence chunk, each beside 1/t of the matmul."""
        group = self.grid.group(rank, ("tp",))
        t, i = len(group), group.index(rank)
        peers = (group[(i + 1) % t], group[(i - 1) % t])
        for step in range(t):
            moving = self.exchange(rank, peers, self.activation // t, "tp", t) if step < t - 1 else []
            self.compute(rank, seconds / t, label)
            self.wait(rank, moving, "tp")

    def norm_gradient(self, rank: int) -> None:
        """With sequence parallelism each norm sees its part of the sequence: its weight gradient is summed."""
        if self.sp:
            group = self.grid.group(rank, ("tp",))
            self.collective(rank, COMPUTE, "all_reduce", group, self.model.dim * self.weight_element, "tp")

    def tensor_parallel(self, rank: int) -> None:
        """One tensor-parallel region's collectives (forward: its exit; backward: its entry, the conjugate)."""
        if self.d.tp == 1:
            return
        group = self.grid.group(rank, ("tp",))
        if self.tp_overlap:  # the rings alone (a zero-bubble input-gradient pass)
            self.tp_ring(rank, 0.0, "tp")
            self.tp_ring(rank, 0.0, "tp")
        elif self.sp:
            self.collective(rank, COMPUTE, "all_gather", group, self.activation, "tp")
            self.collective(rank, COMPUTE, "reduce_scatter", group, self.activation, "tp")
        else:
            self.collective(rank, COMPUTE, "all_reduce", group, self.activation, "tp")

    def attention(self, rank: int, other: float, core: float, label: str, backward: bool) -> None:
        """The attention half: its projections, then the core as the context-parallel method runs it
        (parallel/context_parallel.py): Ulysses all-to-alls q, k and v to heads and the output back (backward:
        the inverse ones), ring attention passes K/V blocks around its ring, overlapped with the core's steps.
        The attention's other tensor-parallel all-reduces (plan/estimate.py `attention_all_reduces`: q/k norms,
        weights whole on every rank) follow the projections in forward and the core in backward."""
        self.compute(rank, other, label)
        if not backward:
            self.attention_tp_calls(rank, False)
        self.attention_core(rank, core, label, backward)
        if backward:
            self.attention_tp_calls(rank, True)

    def attention_tp_calls(self, rank: int, backward: bool) -> None:
        """The attention's all-reduces over the tensor-parallel group beside its region's entry and exit."""
        calls = self.attention_calls[int(backward)]
        if calls:
            group = self.grid.group(rank, ("tp",))
            for nbytes in calls:
                self.collective(rank, COMPUTE, "all_reduce", group, nbytes, "tp")

    def attention_core(self, rank: int, core: float, label: str, backward: bool) -> None:
        """The attention core on this rank, with context parallelism's exchanges."""
        if self.d.cp == 1:
            self.compute(rank, core, label)
            return
        from fivefold.parallel.context_parallel import ContextParallelLayout, _kv_repeats

        cp, t, m, tp = self.config.context_parallel, self.config.train, self.model, self.d.tp
        local = t.micro_batch_size * (t.seq_len // self.d.cp)  # tokens this rank holds
        layout = ContextParallelLayout.for_method(cp.method, self.d.cp, cp.heads, cp.inner_ring, cp.placement)
        heads = layout.heads
        q_heads, kv_heads = m.n_heads // tp, max(m.kv_heads // tp, 1)
        repeats = _kv_repeats(q_heads, kv_heads, heads) if heads > 1 else 1
        q_bytes = local * q_heads * m.head_size * self.element
        kv_bytes = local * kv_heads * repeats * m.head_size * self.element  # one of k, v
        members = self.grid.group(rank, ("cp",))  # in cp-rank order
        ring_rank, head_rank = layout.coords(self.grid.coords(rank)["cp"])
        head_group = tuple(members[layout.cp_rank(ring_rank, h)] for h in range(layout.heads))
        ring = [members[layout.cp_rank(i, head_rank)] for i in range(layout.ring)]
        to_heads = (q_bytes, kv_bytes, kv_bytes) if not backward else (q_bytes,)
        if heads > 1:  # forward: q, k, v to heads; backward: the output's gradient to heads
            for nbytes in to_heads:
                self.collective(rank, COMPUTE, "all_to_all", head_group, nbytes, "cp")
        if layout.ring > 1:
            self.ring_attention(rank, layout, ring, ring_rank, 2 * kv_bytes, core, label, backward)
        else:
            self.compute(rank, core, label)
        if heads > 1:  # forward: the output back to the sequence; backward: q, k, v's gradients
            for nbytes in ((q_bytes,) if not backward else (q_bytes, kv_bytes, kv_bytes)):
                self.collective(rank, COMPUTE, "all_to_all", head_group, nbytes, "cp")

    def ring_attention(self, rank: int, layout, ring: list[int], me: int, nbytes: int, core: float, label: str,
                       backward: bool) -> None:
        """Ring attention as parallel/context_parallel.py runs it: `outer` rounds of an `inner` ring, a K/V block
        per inner step beside 1/ring of the core, each round's first block one outer hop meanwhile; in backward
        each block's gradient follows it, back to the round's first holder, then one outer hop per round."""
        peers = {which: (ring[nxt], ring[prev]) for which, (nxt, prev) in layout.ring_peers(me).items()}
        spans = {"inner": layout.inner_span() * self.d.tp, "outer": self.d.cp * self.d.tp}  # the planner's links
        w, o = layout.inner_size, layout.outer
        pending: list = []
        outer_pending: list = []
        for round_ in range(o):
            arriving = self.exchange(rank, peers["outer"], nbytes, "cp", spans["outer"]) if round_ < o - 1 else []
            for step in range(w):
                moving = self.exchange(rank, peers["inner"], nbytes, "cp", spans["inner"]) if step < w - 1 else []
                self.compute(rank, core / layout.ring, label)
                if backward:
                    self.wait(rank, pending, "cp", layout.ring)
                    pending = self.exchange(rank, peers["inner"], nbytes, "cp", spans["inner"]) if w > 1 else []
                self.wait(rank, moving, "cp", layout.ring)
            if backward:
                self.wait(rank, pending, "cp", layout.ring)
                self.wait(rank, outer_pending, "cp", layout.ring)
                pending, outer_pending = [], self.exchange(rank, peers["outer"], nbytes, "cp", spans["outer"]) if o > 1 else []
            self.wait(rank, arriving, "cp", layout.ring)
        self.wait(rank, outer_pending, "cp", layout.ring)

    # ------------------------------------------------------------------ data parallelism
    def data_parallel_setup(self, rank: int) -> None:
        """This rank's DataParallel / ZeroDataParallel instances as the runtime builds them (parallelize.py
        apply_data_parallel): the dense weights over dp x cp; with routed experts, theirs over the expert-data-
        parallel group, a second instance (plain ZeRO at the same stage, or DDP buckets of their own)."""
        from fivefold.parallel.shard_layout import ShardDegrees

        z = self.config.data_parallel
        stages = list(range(self.grid.coords(rank)["pp"], len(self.split), self.d.pp))
        self.dp_group = self.grid.group(rank, ("dp_replicate", "dp_shard", "cp"))
        self.degrees = zero_degrees(self.config, self.d)
        self.ddp_parts: list[_DdpPart] = []
        self.zero_parts: list[_ZeroPart] = []
        if self.ps:  # the workers push to and pull from the servers instead (`push_pull`)
            return
        if self.degrees is not None:  # the runtime's groups (parallel/shard_layout.py), as global ranks
            position = self.dp_group.index(rank)
            self.zero_groups = {kind: tuple(self.dp_group[i] for i in self.degrees.group_of(kind, position))
                                for kind in GROUP_KINDS}
            self.shard_group = self.zero_groups["block"]
        edp = self.expert_groups["edp"][rank] if self.expert_groups else (rank,)
        for experts, group in ((False, self.dp_group), (True, edp)):
            if len(group) == 1:
                continue
            if z.zero_stage:
                degrees = self.degrees if not experts else ShardDegrees.for_stage(z.zero_stage, len(group))
                groups = self.zero_groups if not experts else \
                    {kind: group if degrees.size(kind) > 1 else (rank,) for kind in GROUP_KINDS}
                shards = degrees.optim  # each group padded to a multiple of the optimizer degree
                flat = {(s, unit.name): [-(-n // shards) * shards for n in
                                         (unit.expert_groups if experts else unit.flat_groups)]
                        for s in stages for unit in self.units[s]}
                self.zero_parts.append(_ZeroPart(degrees, groups, flat, dense=not experts))
            else:
                self.ddp_parts.append(self._buckets(group, stages, experts))

    def _buckets(self, group: tuple[int, ...], stages: list[int], experts: bool) -> _DdpPart:
        """DDP: the runtime's buckets over this rank's parameters (the routed experts', or the others'), in
        registration order, stage by stage; each is ready when backward has passed its earliest unit."""
        from fivefold.parallel.data_parallel import make_buckets

        g = self.config.gradient_comm
        part = _DdpPart(group)
        order = [(s, unit.name, (e, unit.rows.get(name, 0))) for s in stages for unit in self.units[s]
                 for name, e in (unit.experts if experts else unit.params)]
        order.sort(key=lambda item: item[1] != TIED_COPY)  # registered first (tok_embeddings), though used last
        # a bucket is ready when backward has passed the unit it holds that backward reaches last: the earliest in
        # the units' forward order (the tied copy's gradient is complete right after the head's)
        forward_position = {(s, unit.name): i for i, (s, unit) in
                            enumerate((s, unit) for s in stages for unit in self.units[s])}
        dtype = torch.bfloat16 if g.reduce_dtype == "bf16" else torch.float32
        tensors = [torch.empty(e, device="meta") for *_, (e, _) in order]
        owner = {id(t): (s, unit) for t, (s, unit, _) in zip(tensors, order)}
        shape = {id(t): kept for t, (*_, kept) in zip(tensors, order)}
        buckets = make_buckets(tensors, g.bucket_mb, dtype)
        for bucket in buckets:
            part.buckets.append(bucket.buffer.numel() * bucket.buffer.element_size())
            part.contents.append([shape[id(t)] for t in bucket.params])
            first = min((owner[id(t)] for t in bucket.params), key=forward_position.get)  # backward runs units in reverse
            part.bucket_of[first].append(len(part.buckets) - 1)
        if self.priority and not experts:  # the runtime's slices (the priority schedule refuses routed experts)
            from types import SimpleNamespace

            from fivefold.parallel.comm_schedule import plan_slices

            element = dtype.itemsize
            cut = plan_slices(SimpleNamespace(params=tensors, buckets=buckets), max(1, int(g.slice_mb * 2**20) // element))
            part.slices = [PrioritySlice(c.bucket, (c.hi - c.lo) * element, c.priority) for c in cut]
            for b, bucket in enumerate(buckets):
                for t, lo in zip(bucket.params, bucket.offsets):
                    hi = lo + t.numel()
                    mine = part.unit_slices.setdefault(owner[id(t)], [])
                    mine += [k for k, c in enumerate(cut) if c.bucket == b and c.lo < hi and c.hi > lo and k not in mine]
        return part

    def dp_algorithm(self, nbytes: int, p: int) -> str:
        algorithm = self.config.gradient_comm.allreduce_algorithm
        if algorithm == "auto":
            return best_all_reduce(nbytes, p, self.cluster.links())
        return algorithm

    def launch(self, rank: int, kind: str, nbytes: int, members: tuple[int, ...], algorithm: str = "native") -> str:
        """Hand one collective to the communication thread; returns the event set when it is done."""
        start, done = self._event(rank, "launch"), self._event(rank, "done")
        self.programs[(rank, COMPUTE)].append(Notify(start))
        self.programs[(rank, DP)].append(Await(start, "idle"))
        self.collective(rank, DP, kind, members, nbytes, "dp", algorithm)
        self.programs[(rank, DP)].append(Notify(done))
        return done

    def gradients_ready(self, rank: int, stage: int, unit: Unit, last: bool) -> None:
        """The hooks of a unit whose backward just ended: DDP buckets it completes (in the last micro-batch
        without a pipeline), ZeRO groups it fills (whole gradients: then too; sharded ones: in every micro-batch)."""
        z = self.config.data_parallel
        for i, part in enumerate(self.ddp_parts):
            if last:
                for b in part.bucket_of.get((stage, unit.name), []):
                    self.reduce_bucket(rank, i, b)
        for i, part in enumerate(self.zero_parts):
            whole = part.degrees.grads == 1  # whole gradients: reduced once, over the block, into optimizer pieces
            if whole and not last:
                continue
            for n in part.flat[(stage, unit.name)]:
                if part.dense and z.gradient_bits:
                    self.quantized_reduce_scatter(rank, n)
                    continue
                group = part.groups["split" if whole else "grads"]
                if len(group) > 1:
                    self.pending.append(self.launch(rank, "reduce_scatter", n * self.reduce_element, group))
            self.reduced.add((i, stage, unit.name))

    def reduce_bucket(self, rank: int, i: int, b: int) -> None:
        """Launch DDP instance i's bucket b on the communication thread: one all-reduce, or its codec's exchanges;
        under the priority schedule its slices become ready (`priority_reduce` plays them)."""
        part = self.ddp_parts[i]
        if part.slices:
            self.programs[(rank, COMPUTE)].append(Notify(f"s{self.step}-ready{b}"))
        elif self.config.gradient_comm.compression != "none":
            self.compressed_reduce(rank, part.contents[b], part.group)
        else:
            nbytes = part.buckets[b]
            self.pending.append(self.launch(rank, "all_reduce", nbytes, part.group, self.dp_algorithm(nbytes, len(part.group))))
        self.launched.add((i, b))

    def compressed_reduce(self, rank: int, tensors: list[tuple[int, int]], group: tuple[int, ...]) -> None:
        """One DDP bucket of `tensors` ((elements, rows) each) through its codec (comm/compression.py), on the
        communication thread: int8 / sign all-to-all the bucket's codes and its scales (pairwise), then
        ring-all-gather the chunk owners' re-compressed sums; top-k ring-all-gathers every rank's k values and int32
        indices; PowerSGD all-reduces (gradient_comm.allreduce_algorithm) its P factors with the tensors it does not
        compress, then its Q factors, in fp32."""
        g, p = self.config.gradient_comm, len(group)
        if g.compression == "powersgd":
            exchanges = [("all_reduce", self.dp_algorithm(4 * values, p), 4 * values)
                         for values in powersgd_factors(tensors, g.powersgd_rank)[:2]]
        else:
            exchanges = codec_exchanges(g, sum(n for n, _ in tensors), p)
        self.codec_work(rank, self.cluster.accelerator.codec_seconds(g.compression, sum(n for n, _ in tensors), p))
        for kind, algorithm, nbytes in exchanges:
            self.pending.append(self.launch(rank, kind, nbytes, group, algorithm))

    def codec_work(self, rank: int, seconds: float) -> None:
        """The codec's local work on a bucket (Accelerator.codec_seconds), before its messages on the communication
        thread: a stream of its own, so that on a CPU host it shares the cores with the ranks' compute (step.py)."""
        if seconds <= 0:
            return
        start, begin, end = self._event(rank, "launch"), self._event(rank, "encode"), self._event(rank, "encoded")
        self.programs[(rank, COMPUTE)].append(Notify(start))
        self.programs[(rank, DP)] += [Await(start, "idle"), Notify(begin), Await(end, "codec")]
        self.programs[(rank, CODEC)] += [Await(begin, "idle"), Compute(seconds, "codec"), Notify(end)]

    def quantized_reduce_scatter(self, rank: int, padded: int) -> None:
        """qgZ (parallel/zero_pp.py): all-to-alls of codes and scales within the node, then across the nodes."""
        from fivefold.parallel.zero_pp import node_rows

        z = self.config.data_parallel
        shard = padded // len(self.shard_group)
        intra_rows, inter_rows = node_rows([list(self.shard_group)], self.zero_node)
        intra = next(tuple(row) for row in intra_rows if rank in row)
        inter = next(tuple(row) for row in inter_rows if rank in row)
        for group, row in ((intra, len(inter) * shard), (inter, shard)):
            codes, scales = quantized_parts(row, z.gradient_bits, z.quantization_block)
            for nbytes in (len(group) * codes, len(group) * scales):
                self.pending.append(self.launch(rank, "all_to_all", nbytes, group))

    def hpz_group(self, rank: int) -> tuple[int, ...]:
        """hpZ: the secondary partition holding `rank` (the runtime's rows, parallel/zero_pp.py)."""
        from fivefold.parallel.zero_pp import hpz_rows

        rows = hpz_rows([list(self.shard_group)], self.config.data_parallel.hpz_partition, self.zero_node)
        return next(tuple(row) for row in rows if rank in row)

    def gather(self, rank: int, stage: int, unit: Unit, backward: bool = False) -> str:
        """ZeRO-3: launch the all-gathers of a unit's weights (once until they are waited for): from the hpZ
        secondary shards within the node for a block's backward, else from the primary shards (int8 codes and
        scales: qwZ); the routed experts' over their expert-data-parallel group."""
        z = self.config.data_parallel
        key = (stage, unit.name)
        if key not in self.gathering:
            self.gathering[key] = ""
            for part in self.zero_parts:
                if part.degrees.params == 1:
                    continue
                for n in part.flat[key]:
                    if part.dense and backward and unit.index >= 0 and z.hpz_partition > 1:
                        pieces = [(n * self.weight_element, self.hpz_group(rank))]
                    elif part.dense and z.quantized_weights:
                        codes, scales = quantized_parts(n // len(self.shard_group), 8, z.quantization_block)
                        pieces = [(len(self.shard_group) * codes, self.shard_group),
                                  (len(self.shard_group) * scales, self.shard_group)]
                    else:
                        pieces = [(n * self.weight_element, part.groups["params"])]
                    for nbytes, group in pieces:
                        self.gathering[key] = self.launch(rank, "all_gather", nbytes, group)
        return self.gathering[key]

    def zero3_before(self, rank: int, stage: int, blocks: list[Unit], position: int, backward: bool = False) -> None:
        """ZeRO-3's pre-hook of blocks[position]: gather it and wait, prefetch the next block (forward order
        in forward, reverse in backward: `blocks` is in the pass's order). On ranks sharing a CPU host's cores
        the prefetch starts after the block's pass (`zero3_after`): gloo moves the bytes on the cores the block's
        compute holds, so the prefetched gather does not finish sooner (`dp4-zero3` on 2 cores waited 57.7 ms a
        step in its gathers, the whole of what they take alone; docs/planner.md)."""
        if not self.zero3:
            return
        done = self.gather(rank, stage, blocks[position], backward)
        if position + 1 < len(blocks) and not self.shared_host:
            self.gather(rank, stage, blocks[position + 1], backward)
        if done:
            self.programs[(rank, COMPUTE)].append(Await(done, "dp"))
        self.gathering.pop((stage, blocks[position].name), None)  # freed after this pass (runtime: _free)

    def zero3_after(self, rank: int, stage: int, blocks: list[Unit], position: int, backward: bool = False) -> None:
        """On ranks sharing a CPU host's cores: the prefetch of the block after blocks[position], handed to the
        communication thread once the block's pass is done, still ahead of the block's reduce-scatters (the
        runtime queues it at the block's pre-hook, before its gradients are ready), which then run beside the
        next block's backward."""
        if self.zero3 and self.shared_host and position + 1 < len(blocks):
            self.gather(rank, stage, blocks[position + 1], backward)

    def zero3_root(self, rank: int, stage: int) -> None:
        """ZeRO-3's model pre-hook: the root unit (embedding, final norm, head) is gathered once per step."""
        if not self.zero3 or stage in self.root_gathered:
            return
        self.root_gathered.add(stage)
        events = [self.gather(rank, stage, unit) for unit in self.units[stage] if unit.index < 0]
        if any(events):
            self.programs[(rank, COMPUTE)].append(Await([e for e in events if e][-1], "dp"))

    @property
    def zero3(self) -> bool:
        """Parameters sharded: gathered before each unit's forward and backward."""
        return any(part.degrees.params > 1 for part in self.zero_parts)

    # ------------------------------------------------------------------ passes
    def forward(self, rank: int, stage: int) -> None:
        self.zero3_root(rank, stage)
        blocks = [unit for unit in self.units[stage] if unit.index >= 0]
        position = 0  # the unit's place among the stage's blocks
        for unit in self.units[stage]:
            if self.priority:
                self.deferred_update(rank, stage, unit)
            if unit.index >= 0:
                self.zero3_before(rank, stage, blocks, position)
                self.block_pass(rank, unit, backward=False)
                self.zero3_after(rank, stage, blocks, position)
                position += 1
            elif unit.name == "head":
                self.vocab_parallel(rank, "head", backward=False)
                self.compute(rank, self.costs.head, "forward")
                self.vocab_parallel(rank, "loss", backward=False)
            elif unit.name == "embedding":
                self.vocab_parallel(rank, "embedding", backward=False)

    def vocab_parallel(self, rank: int, part: str, backward: bool) -> None:
        """Tensor parallelism outside the blocks: the vocab-parallel embedding sums its lookups (forward), the
        final norm opens the head's region, the vocab-parallel cross-entropy all-reduces each token's max
        logit, sum of exponentials and target logit (tensor_parallel.py)."""
        if self.d.tp == 1:
            return
        group = self.grid.group(rank, ("tp",))
        if part == "loss":
            t = self.config.train
            for _ in range(3):
                self.collective(rank, COMPUTE, "all_reduce", group, t.micro_batch_size * (t.seq_len // self.d.cp) * 4, "tp")
            return
        exit_region = (part == "embedding") != backward  # the embedding leaves a region, the head's norm enters one
        if self.sp:
            self.collective(rank, COMPUTE, "reduce_scatter" if exit_region else "all_gather", group, self.activation, "tp")
        elif exit_region:
            self.collective(rank, COMPUTE, "all_reduce", group, self.activation, "tp")

    def backward(self, rank: int, stage: int, last: bool, part: str = "B") -> None:
        """A stage's backward (part B), or its input-gradient (I) or weight-gradient (W) half (zero bubble)."""
        units = list(reversed(self.units[stage]))
        blocks = [unit for unit in units if unit.index >= 0]
        recompute = self.config.train.recompute
        share = {"B": 1.0, "I": 0.5, "W": 0.5}[part]
        position = 0  # the unit's place among the (reversed) stage's blocks
        for unit in units:
            if unit.index >= 0:
                position += 1
                if part == "W":
                    self.compute(rank, 2 * self.costs.block[unit.moe] * share, "backward")
                else:
                    self.zero3_before(rank, stage, blocks, position - 1, backward=True)
                    if recompute == "full":
                        self.block_pass(rank, unit, backward=False, recompute=True)
                    elif recompute == "selective":  # the attention core again, context parallelism's messages too
                        self.attention_core(rank, self.costs.core, "recompute", backward=False)
                    if part == "B":
                        self.block_pass(rank, unit, backward=True)
                    else:  # the input gradient: half the compute, all of the block's collectives
                        self.half_block_backward(rank, unit)
                    self.zero3_after(rank, stage, blocks, position - 1, backward=True)
            elif unit.name == "head":
                self.compute(rank, 2 * self.costs.head * share, "backward")
                if part != "W":
                    self.vocab_parallel(rank, "head", backward=True)
                    self.norm_gradient(rank)
            elif part != "W" and unit.name == "embedding":
                self.vocab_parallel(rank, "embedding", backward=True)
            if part != "I":
                self.gradients_ready(rank, stage, unit, last)

    def half_block_backward(self, rank: int, unit: Unit) -> None:
        forward, core = self.costs.block[unit.moe], self.costs.core
        if unit.moe:
            self.experts(rank, forward / 2, "backward", True, unit.index, 1.0)
        else:
            self.compute(rank, forward / 2, "backward")
            self.tensor_parallel(rank)
        self.norm_gradient(rank)
        self.attention(rank, forward / 2 - core, core, "backward", True)
        self.tensor_parallel(rank)
        self.norm_gradient(rank)

    def finish(self, rank: int) -> None:
        """reduce_grads: sum a tied embedding's two stage copies, launch what is left, wait for the communication
        thread; hybrid shards over replicas."""
        stages = range(self.grid.coords(rank)["pp"], len(self.split), self.d.pp)
        pair = tied_embedding_pair(self.model, self.d, self.split, self.grid.group(rank, ("pp",)))
        if rank in pair:
            self.collective(rank, COMPUTE, "all_reduce", pair, tied_embedding_bytes(self.model, self.d, self.config),
                            "pp")
        for i, part in enumerate(self.ddp_parts):
            for b in range(len(part.buckets)):
                if (i, b) not in self.launched:
                    self.reduce_bucket(rank, i, b)
        for i, part in enumerate(self.zero_parts):
            if part.degrees.grads == 1 and len(part.groups["split"]) > 1:
                for s in stages:
                    for unit in self.units[s]:
                        if (i, s, unit.name) not in self.reduced:
                            for n in part.flat[(s, unit.name)]:
                                self.pending.append(self.launch(rank, "reduce_scatter", n * self.reduce_element,
                                                                part.groups["split"]))
        if self.pending:
            self.programs[(rank, COMPUTE)].append(Await(self.pending[-1], "dp"))
        for part in self.ddp_parts:
            if part.slices:
                self.priority_reduce(rank, part)
        self.replicated_experts(rank)
        for part in self.zero_parts:
            deg, groups = part.degrees, part.groups
            pieces = [n for s in stages for unit in self.units[s] for n in part.flat[(s, unit.name)]]
            if deg.grads > 1 and len(groups["split"]) > 1:  # gradient pieces into optimizer pieces
                for n in pieces:
                    self.collective(rank, COMPUTE, "reduce_scatter", groups["split"],
                                    n // deg.grads * self.reduce_element, "dp")
            if len(groups["replica"]) > 1:
                for n in pieces:
                    self.collective(rank, COMPUTE, "all_reduce", groups["replica"],
                                    n // deg.optim * self.reduce_element, "dp")

    def priority_reduce(self, rank: int, part: _DdpPart) -> None:
        """The priority schedule's communication thread for this step (parallel/comm_schedule.py
        `_negotiate_and_reduce`): each slice, in `slice_order`, once its bucket is ready: the readiness vector's
        all-reduce (4 bytes a slice, the backend's), then the slice's all-reduce (gradient_comm.allreduce_algorithm).
        The step does not wait: each module's next forward waits for its own slices (`deferred_update`)."""
        order = self.slice_order if self.slice_order is not None else first_guess_order(part.slices)
        if sorted(order) != list(range(len(part.slices))):
            raise ValueError(f"slice_order {order}: not an order of the {len(part.slices)} slices")
        key, p = (rank, DP), len(part.group)
        for k in order:
            piece = part.slices[k]
            self.programs[key] += [Await(f"s{self.step}-ready{piece.bucket}", "idle"), Notify(f"s{self.step}-begin{k}")]
            self.collective(rank, DP, "all_reduce", part.group, 4 * len(part.slices), "dp")
            self.collective(rank, DP, "all_reduce", part.group, piece.nbytes, "dp", self.dp_algorithm(piece.nbytes, p))
            self.programs[key].append(Notify(f"s{self.step}-slice{k}"))

    def deferred_update(self, rank: int, stage: int, unit: Unit) -> None:
        """The priority schedule defers each module's update to its next forward (comm_schedule.py `_apply`): from
        the second step on, a unit's first forward of the step (later micro-batches' find it done) waits for the
        previous step's slices holding its parameters, then runs AdamW on them. (The runtime does this per module;
        here per unit, a block's modules together.)"""
        if self.step == 0 or (stage, unit.name) in self.updated:
            return
        self.updated.add((stage, unit.name))
        for part in self.ddp_parts:
            for k in part.unit_slices.get((stage, unit.name), []):
                self.programs[(rank, COMPUTE)].append(Await(f"s{self.step - 1}-slice{k}", "dp"))
        elements = sum(e for _, e in unit.params)
        if elements:
            self.compute(rank, self.cluster.accelerator.optimizer_seconds(elements, len(unit.params)), "optimizer")

    def replicated_experts(self, rank: int) -> None:
        """EPLB (parallel/expert_parallel.py `ReplicaGradients`): after DDP's reduction, each replicated expert this
        rank holds has its gradient all-reduced over the expert-parallel ranks holding it, layer by layer, expert by
        expert (the runtime's order)."""
        if not self.placements:
            return
        ep = self.expert_groups["ep"][rank]
        position = ep.index(rank)
        for layer in sorted(self.placements):
            holders = replica_holders(self.placements[layer])
            for e in sorted(holders):
                if len(holders[e]) > 1 and position in holders[e]:
                    self.collective(rank, COMPUTE, "all_reduce", tuple(ep[p] for p in holders[e]),
                                    self.expert_bytes * self.weight_element, "dp")

    def scalars(self, rank: int) -> None:
        """The step's scalar all-reduces (plan/estimate.py `scalar_groups`: token count, gradient norm per group, the
        guard's verdict) over this rank's groups, each by formula at every fidelity: a few bytes, its latency."""
        groups = {"dp_cp": lambda: self.dp_group, "shard": lambda: self.shard_group,
                  "tp": lambda: self.grid.group(rank, ("tp",)), "pp": lambda: self.grid.group(rank, ("pp",)),
                  "expert_shard": lambda: self.expert_groups["edp"][rank],
                  "ep": lambda: self.expert_groups["ep"][rank], "etp": lambda: self.expert_groups["etp"][rank],
                  "world": lambda: tuple(range(self.d.world))}
        for _, nbytes, group in scalar_groups(self.config, self.model, self.d):
            if group in ("expert_shard", "ep", "etp") and not self.expert_groups:
                continue
            self.collective(rank, COMPUTE, "all_reduce", groups[group](), nbytes, "scalars", by_formula=True)

    def optimizer(self, rank: int) -> None:
        """The step's scalar all-reduces (`scalars`), then AdamW over this rank's (ZeRO: sharded) parameters at the
        accelerator's optimizer rate, with its cost per tensor updated (ZeRO: per flat group); offload: the shard's
        trips to the host and, with NVMe, the drives, as the planner prices them. ZeRO-1/2 gather the new weights."""
        self.scalars(rank)
        if self.priority:  # each module is updated at its next forward (`deferred_update`)
            return
        z = self.config.data_parallel
        stages = list(range(self.grid.coords(rank)["pp"], len(self.split), self.d.pp))
        shards = {not part.dense: part.degrees.optim for part in self.zero_parts}  # experts? -> optimizer degree
        units = [unit for s in stages for unit in self.units[s]]
        params = sum(e / shards.get(False, 1) for unit in units for _, e in unit.params) + \
            sum(e / shards.get(True, 1) for unit in units for _, e in unit.experts)
        tensors = sum((len(unit.flat_groups) if False in shards else len(unit.params))
                      + (len(unit.expert_groups) if True in shards else len(unit.experts)) for unit in units)
        if not z.offload:  # the gradient norm and clipping, then AdamW
            accelerator = self.cluster.accelerator
            self.compute(rank, accelerator.clip_seconds(params, self.config.train.max_grad_norm > 0)
                         + accelerator.optimizer_seconds(params, tensors), "optimizer")
        self.compute(rank, offload_seconds(self.config, params, self.cluster), "offload")
        for part in self.zero_parts:
            if len(part.groups["publish"]) > 1:  # the updated optimizer pieces into each rank's parameter piece
                for s in stages:
                    for unit in self.units[s]:
                        for n in part.flat[(s, unit.name)]:
                            self.collective(rank, COMPUTE, "all_gather", part.groups["publish"],
                                            n // part.degrees.params * self.weight_element, "dp")

    # ------------------------------------------------------------------ parameter servers
    def push_pull(self, rank: int) -> None:
        """A worker after its backward (parallel/parameter_server.py): its gradients pushed to every server (each
        server's shard, 4 bytes a value), the new weights pulled back, then the next step may start; under asp and
        ssp the worker first takes its own gradient's norm and clips it (the planner's `clip_seconds`)."""
        key, handles = (rank, COMPUTE), []
        if self.async_ps:
            elements = sum(e for e, _ in self.loads)
            self.compute(rank, self.cluster.accelerator.clip_seconds(elements, self.config.train.max_grad_norm > 0),
                         "optimizer")
            self.programs[key].append(Notify(f"s{self.step}-push"))
        for server, (elements, _) in zip(self.server_ranks, self.loads):
            handles.append(self._handle(key))
            self.programs[key].append(Send(server, 4 * elements, handles[-1]))
            self.log[rank].append(("send", (rank, server), 4 * elements, "", None))
        for server, (elements, _) in zip(self.server_ranks, self.loads):
            handles.append(self._handle(key))
            self.programs[key].append(Recv(server, 4 * elements, handles[-1]))
        self.programs[key].append(Wait(tuple(handles), "dp"))
        if self.async_ps:
            self.programs[key].append(Notify(f"{SNAPSHOT}s{self.step}"))

    def async_server_program(self, rank: int) -> None:
        """A server under asp / ssp (parameter_server.py `_serve_asynchronous`) for the simulated steps: each push
        as it arrives, in `push_orders` (default: the workers in turn, step by step), stepped at once (the
        planner's `server_update_seconds` for one push) and answered, under ssp only once the pusher is at most
        `staleness` steps ahead of the slowest worker (or done): the runtime's rule on the same clocks."""
        key, workers = (rank, COMPUTE), self.d.dp
        elements, tensors = self.loads[self.server_ranks.index(rank)]
        order = self.push_orders[rank]
        if sorted(order) != sorted(w for _ in range(self.steps) for w in range(workers)):
            raise ValueError(f"push order {order}: not {self.steps} pushes of each of {workers} workers")
        ps = self.config.parameter_server
        bound = ps.staleness if ps.sync == "ssp" else None
        update = server_update_seconds(self.config, elements, tensors, 1, self.cluster.accelerator)
        clocks, waiting, sends = [0] * workers, [], []
        for w in order:
            received = self._handle(key)
            self.programs[key] += [Recv(w, 4 * elements, received), Wait((received,), "dp")]
            self.compute(rank, update, "optimizer")
            clocks[w] += 1
            waiting.append(w)
            slowest = min(clocks)
            for v in [v for v in waiting if bound is None or clocks[v] >= self.steps or clocks[v] - slowest <= bound]:
                waiting.remove(v)
                sends.append(self._handle(key))
                self.programs[key].append(Send(v, 4 * elements, sends[-1]))
                if len(sends) <= workers:  # the calls of one step's worth
                    self.log[rank].append(("send", (rank, v), 4 * elements, "", None))
        self.programs[key].append(Wait(tuple(sends), "dp"))

    def server_program(self, rank: int) -> None:
        """A server's step: every worker's push of its shard, their sum, the norm and clipping, AdamW
        (`server_update_seconds`, the planner's), then the new shard sent to every worker."""
        key, workers = (rank, COMPUTE), range(self.d.dp)
        elements, tensors = self.loads[self.server_ranks.index(rank)]
        receives = [self._handle(key) for _ in workers]
        self.programs[key] += [Recv(w, 4 * elements, h) for w, h in zip(workers, receives)]
        self.programs[key].append(Wait(tuple(receives), "dp"))
        self.compute(rank, server_update_seconds(self.config, elements, tensors, self.d.dp, self.cluster.accelerator),
                     "optimizer")
        sends = [self._handle(key) for _ in workers]
        for w, h in zip(workers, sends):
            self.programs[key].append(Send(w, 4 * elements, h))
            self.log[rank].append(("send", (rank, w), 4 * elements, "", None))
        self.programs[key].append(Wait(tuple(sends), "dp"))

    # ------------------------------------------------------------------ a rank's step
    def rank_program(self, rank: int) -> None:
        from fivefold.parallel.pipeline.schedules import Instruction, Op as P, PipelineShape, schedule

        if rank in self.server_ranks:
            (self.async_server_program if self.async_ps else self.server_program)(rank)
            return

        d, t, pipe = self.d, self.config.train, self.config.pipeline_parallel
        m = t.grad_accum_steps
        coords = self.grid.coords(rank)
        if d.pp > 1:
            stream = schedule(pipe.schedule, PipelineShape(d.pp, m, pipe.virtual), coords["pp"])
        else:
            stream = [Instruction(op, mb, 0) for mb in range(m) for op in (P.FORWARD, P.BACKWARD)]
            stream += [Instruction(P.REDUCE_GRADS), Instruction(P.OPTIMIZER_STEP)]
        self.data_parallel_setup(rank)
        for self.step in range(self.steps):
            self.step_program(rank, stream)
            if self.step == 0:
                logged = len(self.log[rank])
        del self.log[rank][logged:]  # the calls of one step (every step makes the same)

    def step_program(self, rank: int, stream: list) -> None:
        """One optimizer step of `rank`: its instruction stream as the executor runs it."""
        from fivefold.parallel.pipeline.schedules import Op as P

        d, m, pipe = self.d, self.config.train.grad_accum_steps, self.config.pipeline_parallel
        coords = self.grid.coords(rank)
        self.pending: list[str] = []
        self.launched: set[tuple[int, int]] = set()  # (DDP part, bucket)
        self.reduced: set[tuple[int, int, str]] = set()  # (ZeRO part, stage, unit)
        self.gathering: dict[tuple[int, str], str] = {}
        self.root_gathered: set[int] = set()
        self.updated: set[tuple[int, str]] = set()  # the priority schedule: units whose deferred update ran this step
        scatter = pipe.scatter_gather and d.tp > 1  # each tp rank sends its piece; the receivers all-gather
        wire = self.activation // (d.tp if self.sp or scatter else 1)
        key = (rank, COMPUTE)
        posts: list[Op] = []
        receives: list[int] = []
        sends: list[int] = []
        for ins in stream:
            if ins.op in (P.RECV_ACT, P.RECV_GRAD, P.SEND_ACT, P.SEND_GRAD):
                peer = self.grid.rank(**(coords | {"pp": ins.peer}))
                handle = self._handle(key)
                if ins.op in (P.RECV_ACT, P.RECV_GRAD):
                    posts.append(Recv(peer, wire, handle))
                    receives.append(handle)
                else:
                    posts.append(Send(peer, wire, handle))
                    sends.append(handle)
                    self.log[rank].append(("send", (rank, peer), wire, "", None))
                continue
            self.programs[key].extend(posts)  # the executor's batch_isend_irecv at the next compute
            if receives:
                self.programs[key].append(Wait(tuple(receives), "pp"))
                for _ in receives if scatter else ():
                    self.collective(rank, COMPUTE, "all_gather", self.grid.group(rank, ("tp",)), self.activation, "pp")
            posts, receives = [], []
            # DDP and whole-gradient ZeRO reduce in the last micro-batch's backward without a pipeline (the
            # pipeline's micro-batches all run under no_sync); sharded gradients in every one
            last = d.pp == 1 and ins.microbatch == m - 1
            if ins.op == P.FORWARD:
                self.forward(rank, ins.stage)
            elif ins.op in (P.BACKWARD, P.BACKWARD_INPUT, P.BACKWARD_WEIGHT):
                self.backward(rank, ins.stage, last, ins.op.value)
            elif ins.op == P.REDUCE_GRADS:
                if sends:
                    self.programs[key].append(Wait(tuple(sends), "pp"))
                if self.ps:
                    self.push_pull(rank)
                else:
                    self.finish(rank)
            elif ins.op == P.OPTIMIZER_STEP:
                if not self.ps:  # the servers ran AdamW
                    self.optimizer(rank)
                self.routing_report(rank)


def _refuse_unmodelled(config: JobConfig, d: Degrees) -> None:
    g = config.gradient_comm
    reasons = []
    if g.compression == "sign" and g.compression_block % 32:
        reasons.append(f"gradient_comm.compression = sign with compression_block = {g.compression_block}, not a multiple "
                       "of 32 (its 1-bit codes are played as 4-byte words)")
    if reasons:
        raise ConfigError("the step simulator does not model " + "; ".join(reasons) +
                          ": use `fivefold plan` for this layout's estimate")


def build_workload(config: JobConfig, gpus: int, cluster: ClusterSpec, efficiency: float | Efficiency = 0.5,
                   fidelity: str = "hybrid", vocab_size: int = 0, router: Router | None = None,
                   expert_load: dict[str, list] | None = None, slice_order: list[int] | None = None,
                   steps: int = 0, push_orders: dict[int, list[int]] | None = None) -> Workload:
    """Every simulated rank's program for one optimizer step of `config` on `gpus` accelerators of `cluster`
    (router: the fabric the programs will run on, for the aggregate fidelity's latencies; default the
    cluster's own; expert_load: each MoE layer's measured assignments per expert, default balanced). Under the
    priority schedule: `steps` steps (default 2: the second is the steady state), the communication thread
    reducing the slices in `slice_order` (default `first_guess_order`; sim/priority.py finds the runtime's).
    Asynchronous parameter servers: `steps` steps (default ASYNC_STEPS), each server taking the workers' pushes in
    `push_orders` (server rank -> worker per push; default in turn; sim/asynchronous.py finds the arrival order)."""
    builder = _Builder(config, gpus, cluster, efficiency, fidelity, vocab_size, router, expert_load, slice_order, steps,
                       push_orders)
    for rank in builder.simulated:
        builder.rank_program(rank)
    part = next((part for part in getattr(builder, "ddp_parts", []) if part.slices), None)
    slices = part.slices if part else []
    return Workload(dict(builder.programs), builder.grid, builder.d, builder.split, builder.simulated, fidelity,
                    dict(builder.log), builder.expert_imbalance(), recorded=builder.recorded // builder.steps,
                    analytical=builder.analytical // builder.steps, expand=builder._recording, steps=builder.steps, slices=slices,
                    slice_order=list(slice_order) if slice_order is not None else first_guess_order(slices),
                    unit_slices={unit: ks for (_, unit), ks in part.unit_slices.items()} if part else {},
                    server_ranks=builder.server_ranks if builder.async_ps else (),
                    push_orders=builder.push_orders)
