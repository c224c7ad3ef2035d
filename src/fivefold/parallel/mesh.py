"""Parallel dimensions and the mesh that owns every process group of a run.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp), tp innermost:
consecutive global ranks form a tensor-parallel group, so with tp <= GPUs per node a TP group
never leaves a node (its all-reduces are the most frequent and the largest). Then context,
then data (sharded, then replicated), then pipeline outermost, whose point-to-point traffic is
the lightest and can cross the slowest links. `pipeline_parallel.placement = "inner"` moves the
pipeline inside data parallelism, (dp_replicate, dp_shard, pp, cp, tp) as Megatron-LM's tp-pp-dp
order does: one pipeline's stages are neighbours, and the gradient reduction crosses the far links
instead. The mesh's dimensions keep their names and their order (`MESH_DIMS`) either way; only
which global rank sits at each coordinate changes (`ParallelDims.order`).

The mesh is a `torch.distributed.device_mesh.DeviceMesh` with these names, plus three flattened
dimensions: `dp` = (dp_replicate, dp_shard), over which batches are split; `dp_cp` =
(dp_replicate, dp_shard, cp), over which gradients are summed and the loss is token-weighted
(context-parallel ranks hold the same weights and different tokens); and `dp_shard_cp` =
(dp_shard, cp), over which ZeRO shards model states (as torchtitan's FSDP does); `dp_cp_tp` and `cp_tp`,
the ranks holding distinct tokens of one micro-batch or one sequence under sequence parallelism (the
mixture-of-experts routing statistics; expert-parallel groups are cut from them by
parallel/expert_parallel.py).

Every process group of a run is created here (picotron's and torchtitan's rule: one place owns
the topology). Folds that need groups the grid does not name, such as ring attention's head and
ring groups, the first/last pipeline stage pair holding a tied embedding, or a private copy of a
group for a communication thread, hand the mesh the rows of ranks and get their own group back
(`subgroup`). Parameter-server runs have no grid: `Mesh.for_parameter_server` builds the workers'
and the servers' groups.

Every group gets the run's collective timeout (`watchdog.collective_timeout_s` plus two heartbeats,
`collective_timeout`): torch gives groups made after `init_process_group` its 30-minute default
otherwise, so a rank blocked by a dead peer would wait half an hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fivefold.parallel.shard_layout import config_degrees
from fivefold.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
RANK_ORDERS = {"outer": MESH_DIMS, "inner": ("dp_replicate", "dp_shard", "pp", "cp", "tp")}  # slowest-changing first
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_cp": ("dp_shard", "cp"), "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
             "cp_tp": ("cp", "tp")}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    placement: str = "outer"  # pipeline_parallel.placement: the key of RANK_ORDERS

    def __post_init__(self) -> None:
        if self.placement not in RANK_ORDERS:
            raise ConfigError(f"placement = {self.placement!r}: use one of {', '.join(RANK_ORDERS)}")
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} = {getattr(self, name)}: must be a positive integer")
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel dims multiply to pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x cp {self.cp} x tp {self.tp} = {product}, but the world size is {self.world_size}: "
                "make the product equal the number of processes (--nproc-per-node x nodes)"
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways each global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def order(self) -> tuple[str, ...]:
        """The mesh dimensions from the slowest- to the fastest-changing along the global ranks."""
        return RANK_ORDERS[self.placement]

    def rank_grid(self) -> torch.Tensor:
        """The global rank at every coordinate, indexed in `MESH_DIMS` order (a DeviceMesh's mesh tensor)."""
        grid = torch.arange(self.world_size).reshape([getattr(self, name) for name in self.order])
        return grid.permute([self.order.index(name) for name in MESH_DIMS])

    def size(self, name: str) -> int:
        """Ranks along a mesh dimension or a flattened one."""
        parts = FLATTENED.get(name, (name,))
        out = 1
        for part in parts:
            out *= getattr(self, part)
        return out

    def describe_degrees(self) -> str:
        """The degrees in one line, for logs: 'dp 2 x cp 2 x tp 1 x pp 1' (and where the stages lie, if inside dp)."""
        return " x ".join(f"{name} {value}" for name, value in
                          (("dp", self.dp), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))) \
            + (" (pipeline inside dp)" if self.placement == "inner" and self.pp > 1 else "")

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major in `order`, tp innermost)."""
        coords = {}
        for name in reversed(self.order):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        coords["dp"] = coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]
        return {name: coords[name] for name in (*MESH_DIMS, "dp")}

    def describe(self) -> str:
        """The rank grid, one line per (pp, dp_replicate) block, for logs and docs."""
        lines = [f"world {self.world_size} = " + " x ".join(f"{n} {getattr(self, n)}" for n in self.order)]
        blocks = self.rank_grid().reshape(self.pp * self.dp_replicate, -1)
        for block, ranks in enumerate(blocks.tolist()):
            lines.append(f"  block {block}: ranks {ranks}")
        return "\n".join(lines)


@dataclass
class Mesh:
    """Every process group of this rank: the grid's dimensions, flattened ones, and named extras.

    `group(name)` is None where the dimension has one rank (or the run has one process), so
    callers skip communication with a plain `if group is not None`.
    """

    dims: ParallelDims
    device_mesh: DeviceMesh | None = None
    flattened: dict[str, DeviceMesh] = field(default_factory=dict)
    named: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    timeout: timedelta | None = None  # every group's collective timeout (None: torch's default)

    def _sub(self, name: str) -> DeviceMesh:
        if self.device_mesh is None:
            raise KeyError(f"this run has no device mesh (mesh dimension {name!r})")
        return self.flattened[name] if name in self.flattened else self.device_mesh[name]

    def group(self, name: str) -> dist.ProcessGroup | None:
        if name in self.named:
            return self.named[name]
        if self.device_mesh is None or self.dims.size(name) == 1:
            return None
        return self._sub(name).get_group()

    def local_rank(self, name: str) -> int:
        if name in self.named:
            return dist.get_rank(self.named[name]) if self.named[name] is not None else 0
        if self.device_mesh is None or self.dims.size(name) == 1:
            return 0
        return self._sub(name).get_local_rank()

    def ranks(self, name: str) -> list[int]:
        return dist.get_process_group_ranks(self._sub(name).get_group())

    def rank_table(self, name: str) -> torch.Tensor:
        """Global ranks of every group along mesh dimension `name` (or a flattened one, e.g. `dp_shard_cp`): one
        row per group, in group-rank order."""
        if self.device_mesh is None:
            return torch.zeros(1, 1, dtype=torch.long)
        parts = FLATTENED.get(name, (name,))
        positions = [MESH_DIMS.index(part) for part in parts]
        table = self.device_mesh.mesh.movedim(positions, list(range(-len(parts), 0)))
        return table.reshape(-1, self.dims.size(name))

    def subgroup(self, rows: list[list[int]]) -> dist.ProcessGroup | None:
        return subgroup(rows, self.timeout)

    def private_copy(self, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return private_copy(group, self.timeout)

    def trainer_group(self) -> dist.ProcessGroup | None:
        """The ranks that run the training loop together: None (the world) unless parameter servers stand aside."""
        return self.named.get("workers")

    @classmethod
    def single(cls) -> "Mesh":
        """One process: no groups."""
        return cls(ParallelDims())

    @classmethod
    def for_parameter_server(cls, world_size: int, servers: int, timeout: timedelta | None = None) -> "Mesh":
        """Workers are ranks 0 .. W-1, servers the last S; groups `workers` and `servers` (collective)."""
        workers = world_size - servers
        mesh = cls(ParallelDims(dp_replicate=workers, world_size=workers), timeout=timeout)
        worker_group = mesh.subgroup([list(range(workers))])
        server_group = mesh.subgroup([list(range(workers, world_size))])
        mesh.named.update(workers=worker_group, servers=server_group, dp_cp=worker_group, dp=worker_group)
        return mesh


def subgroup(rows: list[list[int]], timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """Create one group per row of global ranks (collective: every rank, same rows, same order).

    Returns the group of the row holding this rank, or None if no row does or rows have one rank.
    """
    me, mine = dist.get_rank(), None
    for ranks in rows:
        if len(ranks) < 2:
            continue
        created = dist.new_group(list(ranks), timeout=timeout)
        if me in ranks:
            mine = created
    return mine


class OwnedGroups:
    """The process groups this rank created between `start()` and `stop()` (the default group aside), to destroy
    together when their owner is done with them.

    A live gloo group keeps its threads and connections for the life of the process, and a process holding
    hundreds of them steps slower: the groups of 18 discarded 4-rank trainers made the next trainer's step a
    third slower (benchmarks/plan_vs_measured.py runs dozens in one process). torch lists live groups only in
    the private `distributed_c10d._world.pg_map`; without it nothing is recorded and nothing destroyed.
    """

    def __init__(self):
        self._before: set | None = None
        self.groups: list[dist.ProcessGroup] = []

    @staticmethod
    def _live() -> set:
        world = getattr(dist.distributed_c10d, "_world", None)
        return set(getattr(world, "pg_map", {})) if dist.is_initialized() else set()

    @classmethod
    def start(cls) -> "OwnedGroups":
        owned = cls()
        owned._before = owned._live()
        return owned

    def stop(self) -> None:
        default = dist.GroupMember.WORLD
        self.groups = [pg for pg in self._live() - (self._before or set()) if pg is not default]

    def destroy(self) -> None:
        """Destroy the recorded groups still alive (every rank of them calls this; a second call does nothing)."""
        live = self._live()
        for pg in self.groups:
            if pg in live:
                dist.destroy_process_group(pg)
        self.groups = []


def private_copy(group: dist.ProcessGroup | None, timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A new group with the same ranks as `group`, for a thread whose collectives outlive the step.

    Ranks learn every rank's group by all_gather_object and create them all in one order, as
    torch.distributed.new_group requires (collective over the world).
    """
    if group is None:
        return None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(dist.get_process_group_ranks(group)))
    return subgroup([list(ranks) for ranks in sorted(set(everyone))], timeout)


def workers_of(config, world_size: int) -> int:
    """Ranks that train: all of them, or all but the parameter servers (a JobConfig's data_parallel.mode)."""
    if config.data_parallel.mode != "ps":
        return world_size
    servers = config.parameter_server.servers
    if world_size <= servers:
        raise ConfigError(f"parameter_server.servers = {servers} leaves no worker among {world_size} ranks: "
                          "start more ranks or use fewer servers")
    return world_size - servers


def dims_for(config, world_size: int) -> ParallelDims:
    """The ParallelDims of a JobConfig on `world_size` ranks (validated: the degrees multiply to the trainers)."""
    trainers = workers_of(config, world_size)
    dp, tp, cp, pp = config.data_parallel, config.tensor_parallel.degree, config.context_parallel.degree, config.pipeline_parallel.degree
    others = pp * dp.shard * cp * tp
    replicate = trainers // others if dp.replicate == -1 else dp.replicate
    dims = ParallelDims(dp_replicate=max(replicate, 1), dp_shard=dp.shard, cp=cp, tp=tp, pp=pp, world_size=trainers,
                        placement=config.pipeline_parallel.placement)
    config_degrees(config, dims)  # the ZeRO sharding degrees fit these ranks (raises ConfigError)
    return dims


def collective_timeout(config) -> timedelta:
    """The groups' timeout: the watchdog's limit plus two heartbeats, so the watchdog's report comes first."""
    w = config.watchdog
    return timedelta(seconds=w.collective_timeout_s + 2 * w.heartbeat_s)


def mesh_for(config, world_size: int, device_type: str) -> Mesh:
    """A run's mesh (collective): the parallel grid over every rank, or the workers' and servers' groups."""
    timeout = collective_timeout(config)
    if config.data_parallel.mode == "ps":
        workers_of(config, world_size)  # enough ranks for workers and servers, or a clear error
        return Mesh.for_parameter_server(world_size, config.parameter_server.servers, timeout)
    return build_mesh(dims_for(config, world_size), device_type, timeout)


def build_mesh(dims: ParallelDims, device_type: str, timeout: timedelta | None = None) -> Mesh:
    """Build the mesh (needs an initialised process group when dims.world_size > 1; every rank calls it)."""
    if dims.world_size == 1:
        return Mesh(dims, timeout=timeout)
    if dims.order == MESH_DIMS:
        device_mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
    else:  # the same named dimensions over a permuted rank grid
        device_mesh = DeviceMesh(device_type, dims.rank_grid(), mesh_dim_names=MESH_DIMS)
    flattened = {name: device_mesh[parts]._flatten(name) for name, parts in FLATTENED.items()}
    if timeout is not None:
        for sub in [*(device_mesh[name] for name in MESH_DIMS if dims.size(name) > 1), *flattened.values()]:
            sub.get_group().set_timeout(timeout)
    return Mesh(dims, device_mesh, flattened, timeout=timeout)
