"""One collective, run by the runtime's own algorithm, over a simulated fabric (`fivefold simulate`).

The ranks' programs come from trace.py (the comm/ algorithm run on meta tensors); the fabric from
the cluster file's [topology] table (topology.py, routing.py); the engine (engine.py) plays the
messages over the flow-level network (network.py). The report sets the simulated time beside
comm/cost.py's alpha-beta prediction, which assumes every message gets its link to itself: the
ratio is what contention (oversubscription, ECMP collisions, shared NICs) costs.

Several jobs can share the fabric, each running the same collective at the same time on its own
accelerators: `packed` gives job j the j-th contiguous block of them (jobs meet only where their
blocks share a switch), `interleaved` deals the slots out in turn (job j takes every jobs-th slot of
`stride` accelerators, so with one rank per node the jobs alternate nodes and share every uplink).
Each job's time is set beside the same job alone on the same accelerators: the ratio is what its
neighbours cost it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from fivefold.comm.cost import bus_factor, predict_collective
from fivefold.errors import ConfigError
from fivefold.plan.cluster import ClusterSpec
from fivefold.sim.engine import SimResult, simulate
from fivefold.sim.names import PLACEMENTS
from fivefold.sim.network import flow_network
from fivefold.sim.routing import cluster_router
from fivefold.sim.topology import Topology
from fivefold.sim.trace import as_streams, collective_programs, resolve_algorithm


@dataclass
class CollectiveRun:
    collective: str
    algorithm: str
    members: tuple[int, ...]
    nbytes: int
    topology: Topology
    result: SimResult
    formula: float  # comm/cost.py alpha-beta seconds, no contention
    wall_seconds: float
    job_members: list[tuple[int, ...]] = field(default_factory=list)  # every job's accelerators (job 0's are `members`)
    job_times: list[float] = field(default_factory=list)  # each job's finish, all running together
    alone: float = 0.0  # job 0 on its accelerators with the fabric to itself

    @property
    def time(self) -> float:
        return self.result.time

    def bus_bandwidth(self) -> float:
        """nccl-tests' bus bandwidth: bytes / time, times the collective's (p-1)/p factor."""
        p = len(self.members)
        return self.nbytes / self.time * bus_factor(self.collective, p) if self.time else float("inf")

    def link_utilisation(self) -> list[tuple[str, float]]:
        """(link name, fraction of the run it was busy at full rate), busiest first."""
        return link_utilisation(self.topology, self.result.link_bytes, self.time)


def link_utilisation(topology: Topology, link_bytes: list[float], seconds: float) -> list[tuple[str, float]]:
    """(link name, bytes carried over what it could carry in `seconds`), busiest first; idle links left out."""
    names = topology.vertex_names
    out = []
    for link, carried in zip(topology.links, link_bytes):
        if carried > 0 and seconds > 0:
            out.append((f"{names[link.source]}->{names[link.target]}", carried / (link.bandwidth * seconds)))
    return sorted(out, key=lambda item: -item[1])


def job_placement(ranks: int, stride: int, jobs: int, placement: str) -> list[tuple[int, ...]]:
    """Each job's accelerators: `ranks` slots of `stride` accelerators (a rank at the start of its slot), the
    jobs' slots contiguous (packed) or dealt out in turn (interleaved)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"--placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    if placement == "packed":
        return [tuple((j * ranks + i) * stride for i in range(ranks)) for j in range(jobs)]
    return [tuple((i * jobs + j) * stride for i in range(ranks)) for j in range(jobs)]


def simulate_collective(cluster: ClusterSpec, collective: str, algorithm: str, ranks: int, nbytes: int,
                        stride: int = 1, node_size: int = 0, record_spans: bool = True, jobs: int = 1,
                        placement: str = "packed", congestion: str = "none") -> CollectiveRun:
    """Simulate one fp32 collective of `nbytes` per rank over `ranks` ranks placed `stride` accelerators apart,
    run by each of `jobs` jobs at once (placed as `placement` says; see the module docstring).

    `node_size` (hierarchical only; 0: the ranks of one node) is used by the algorithm and the formula alike.
    """
    for name, value, low in (("--ranks", ranks, 1), ("--stride", stride, 1), ("--bytes", nbytes, 1),
                             ("--node-size", node_size, 0), ("--jobs", jobs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} {value!r}: must be an integer >= {low}")
    if placement != "packed" and jobs == 1:
        raise ConfigError(f"--placement {placement} places several jobs: give --jobs 2 or more")
    algorithm = resolve_algorithm(collective, algorithm)
    placed = job_placement(ranks, stride, jobs, placement)
    members = placed[0]
    router = cluster_router(cluster, ranks * stride * jobs)
    topology = router.topology
    per_node = sum(1 for m in members if m // cluster.accelerators_per_node == 0)  # job 0's ranks in its first node
    node_size = node_size or per_node
    programs = {}
    for job in placed:
        programs.update(as_streams(collective_programs(collective, algorithm, job, nbytes, node_size=node_size)))
    start = time.perf_counter()
    result = simulate(programs, flow_network(router, congestion), record_spans)
    wall = time.perf_counter() - start
    job_times = [max(result.finish[(rank, "comm")] for rank in job) for job in placed]
    alone = result.time if jobs == 1 else simulate(
        as_streams(collective_programs(collective, algorithm, members, nbytes, node_size=node_size)),
        flow_network(router, congestion), False).time
    links = replace(cluster.links(), node_size=node_size if algorithm == "hierarchical" else per_node)
    try:
        formula = predict_collective(collective, algorithm, nbytes, ranks, links)
    except ValueError:  # no closed form (e.g. recursive reduce-scatter on a rank count that folds)
        formula = float("nan")
    return CollectiveRun(collective, algorithm, members, nbytes, topology, result, formula, wall, placed, job_times,
                         alone)
