"""One collective, run by the runtime's own algorithm, over a simulated fabric (`fivefold simulate`).

The ranks' programs come from trace.py (the comm/ algorithm run on meta tensors); the fabric from
the cluster file's [topology] table (topology.py, routing.py); the engine (engine.py) plays the
messages over the flow-level network (network.py). The report sets the simulated time beside
comm/cost.py's alpha-beta prediction, which assumes every message gets its link to itself: the
ratio is what contention (oversubscription, ECMP collisions, shared NICs) costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from fivefold.comm.cost import bus_factor, predict_collective
from fivefold.errors import ConfigError
from fivefold.plan.cluster import ClusterSpec
from fivefold.sim.engine import SimResult, simulate
from fivefold.sim.network import FlowNetwork
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


def simulate_collective(cluster: ClusterSpec, collective: str, algorithm: str, ranks: int, nbytes: int,
                        stride: int = 1, node_size: int = 0, record_spans: bool = True) -> CollectiveRun:
    """Simulate one fp32 collective of `nbytes` per rank over `ranks` ranks placed `stride` accelerators apart.

    `node_size` (hierarchical only; 0: the ranks of one node) is used by the algorithm and the formula alike.
    """
    for name, value, low in (("--ranks", ranks, 1), ("--stride", stride, 1), ("--bytes", nbytes, 1),
                             ("--node-size", node_size, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} {value!r}: must be an integer >= {low}")
    algorithm = resolve_algorithm(collective, algorithm)
    members = tuple(range(0, ranks * stride, stride))
    router = cluster_router(cluster, ranks * stride)
    topology = router.topology
    per_node = max(1, cluster.accelerators_per_node // stride)
    node_size = node_size or per_node
    programs = collective_programs(collective, algorithm, members, nbytes, node_size=node_size)
    start = time.perf_counter()
    result = simulate(as_streams(programs), FlowNetwork(router), record_spans)
    wall = time.perf_counter() - start
    links = replace(cluster.links(), node_size=node_size if algorithm == "hierarchical" else per_node)
    try:
        formula = predict_collective(collective, algorithm, nbytes, ranks, links)
    except ValueError:  # no closed form (e.g. recursive reduce-scatter on a rank count that folds)
        formula = float("nan")
    return CollectiveRun(collective, algorithm, members, nbytes, topology, result, formula, wall)
