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

import torch

from fivefold.comm.cost import predict_collective
from fivefold.errors import ConfigError
from fivefold.plan.cluster import ClusterSpec
from fivefold.sim.engine import SimResult, simulate
from fivefold.sim.network import FlowNetwork
from fivefold.sim.routing import Router
from fivefold.sim.topology import Topology, build_topology
from fivefold.sim.trace import as_streams, collective_programs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BUS_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
               "all_gather": lambda p: (p - 1) / p, "all_to_all": lambda p: (p - 1) / p, "broadcast": lambda p: 1.0}


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
        return self.nbytes / self.time * _BUS_FACTOR[self.collective](p) if self.time else float("inf")

    def link_utilisation(self) -> list[tuple[str, float]]:
        """(link name, fraction of the step it was busy at full rate), busiest first."""
        names = self.topology.vertex_names
        out = []
        for link, carried in zip(self.topology.links, self.result.link_bytes):
            if carried > 0 and self.time > 0:
                out.append((f"{names[link.source]}->{names[link.target]}", carried / (link.bandwidth * self.time)))
        return sorted(out, key=lambda item: -item[1])


def simulate_collective(cluster: ClusterSpec, collective: str, algorithm: str, ranks: int, nbytes: int,
                        dtype: str = "fp32", stride: int = 1, node_size: int = 0,
                        record_spans: bool = True) -> CollectiveRun:
    """Simulate one collective of `nbytes` per rank over `ranks` ranks placed `stride` accelerators apart."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if ranks < 1 or stride < 1:
        raise ConfigError(f"--ranks {ranks} and --stride {stride} must be positive")
    members = tuple(range(0, ranks * stride, stride))
    topology = build_topology(cluster, ranks * stride)
    programs = collective_programs(collective, algorithm, members, nbytes, DTYPES[dtype],
                                   node_size or max(1, cluster.accelerators_per_node // stride))
    spec = cluster.topology
    router = Router(topology, spec.routing, spec.subflows, spec.seed)
    start = time.perf_counter()
    result = simulate(as_streams(programs), FlowNetwork(router), record_spans)
    wall = time.perf_counter() - start
    formula_algorithm = {"native": "ring", "pairwise": "ring"}.get(algorithm, algorithm)
    try:
        links = replace(cluster.links(), node_size=max(1, cluster.accelerators_per_node // stride))
        formula = predict_collective(collective, formula_algorithm, nbytes, ranks, links)
    except ValueError:
        formula = float("nan")
    return CollectiveRun(collective, algorithm, members, nbytes, topology, result, formula, wall)
