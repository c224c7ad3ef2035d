"""One training step simulated: the workload (workload.py) played over the cluster's fabric.

`simulate_step` builds every rank's program from the training config, runs it on the engine over
the flow-level network (or the contention-free one on the analytical path) and reports the step
time with a per-phase breakdown of the slowest rank's compute stream:

    compute, recompute, optimizer   its Compute spans
    tp, cp, ep, dp                  time it waited for that fold's communication (exposed)
    pipeline                        waits for pipeline messages plus idle time: the bubble and the
                                    activation transfers it could not hide

The phases add up to the step time. Under the priority schedule the step is the steady state of
sim/priority.py (the second of two steps, its communication thread's order the runtime's); with asynchronous
parameter servers the workers' steady state of sim/asynchronous.py. The result also carries per-link utilisation, the bytes each
pair of ranks exchanged and a Chrome trace of every simulated rank's streams. On a CPU host whose
ranks share its cores (accelerator.shared_cores) the compute streams run on those cores (cores.py):
a rank waiting for a message or a collective lends its share to the ranks still computing.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from fivefold.config.schema import JobConfig
from fivefold.errors import ConfigError
from fivefold.plan.cluster import ClusterSpec
from fivefold.plan.efficiency import Efficiency
from fivefold.plan.estimate import core_sharing, host_sharing
from fivefold.sim.collective import link_utilisation
from fivefold.sim.cores import SharedCores
from fivefold.sim.engine import SimResult, simulate
from fivefold.sim.network import DedicatedNetwork, flow_network
from fivefold.sim import asynchronous
from fivefold.sim.priority import steady_state
from fivefold.sim.routing import cluster_router
from fivefold.sim.topology import Topology
from fivefold.sim.workload import CODEC, COMPUTE, Workload, build_workload

PHASES = ("compute", "recompute", "optimizer", "offload", "tp", "cp", "ep", "dp", "pipeline")
_COMPUTE_LABELS = {"forward": "compute", "backward": "compute", "recompute": "recompute", "optimizer": "optimizer",
                   "scalars": "optimizer", "offload": "offload"}  # scalars: the step's scalar all-reduces


@dataclass
class StepRun:
    workload: Workload
    topology: Topology
    result: SimResult
    build_seconds: float
    simulate_seconds: float
    order_passes: int = 0  # simulations run to find the priority schedule's slice order (sim/priority.py) or
    # asynchronous parameter servers' push orders (sim/asynchronous.py)

    @property
    def time(self) -> float:
        return self.result.time

    @property
    def slowest_rank(self) -> int:
        """The rank whose compute stream ends last (with asynchronous parameter servers: the slowest worker)."""
        ranks = [r for r in self.workload.simulated if r not in self.workload.server_ranks]
        return max(ranks, key=lambda r: self.result.finish.get((r, COMPUTE), 0.0))

    def breakdown(self, rank: int | None = None) -> dict[str, float]:
        """Seconds per phase (PHASES) of `rank`'s compute stream (the slowest rank's by default); they sum to
        the step time."""
        rank = self.slowest_rank if rank is None else rank
        out = dict.fromkeys(PHASES, 0.0)
        for label, seconds in self.result.labelled.get((rank, COMPUTE), {}).items():
            phase = _COMPUTE_LABELS.get(label, label)
            out[phase if phase in out else "pipeline"] += seconds
        accounted = sum(out.values()) - out["pipeline"]
        out["pipeline"] = max(self.time - accounted, 0.0)
        return out

    def link_utilisation(self) -> list[tuple[str, float]]:
        return link_utilisation(self.topology, self.result.link_bytes, self.time)


def shared_cores(config: JobConfig, workload: Workload, cluster: ClusterSpec) -> tuple[SharedCores | None, frozenset]:
    """The host's cores the ranks' compute streams share (accelerator.shared_cores, the job on one host: the
    planner's rule, plan/estimate.py `core_sharing`), and those streams; (None, empty) on accelerators."""
    if config.data_parallel.mode == "ps":  # workers and servers: every rank's stream shares the cores
        ranks = len(workload.simulated)
        sharing = host_sharing(config, ranks, cluster)
        if sharing is None:
            return None, frozenset()
        return SharedCores(sharing, ranks), frozenset((rank, COMPUTE) for rank in workload.simulated)
    sharing = core_sharing(config, workload.degrees, cluster)
    if sharing is None:
        return None, frozenset()
    world = workload.degrees.world
    cores = SharedCores(dataclasses.replace(sharing, replicas=1), world, world // len(workload.simulated))
    return cores, frozenset((rank, stream) for rank in workload.simulated for stream in (COMPUTE, CODEC))


def simulate_step(config: JobConfig, gpus: int, cluster: ClusterSpec, efficiency: float | Efficiency = 0.5,
                  fidelity: str = "hybrid", vocab_size: int = 0, record_spans: bool = True,
                  congestion: str = "none", expert_load: dict[str, list] | None = None) -> StepRun:
    """Simulate one optimizer step of `config` on `gpus` accelerators of `cluster` (see workload.py);
    record_spans=False keeps each stream's seconds per label (the breakdown) but not every span (the trace);
    expert_load: each MoE layer's measured assignments per expert, or one such list per EP position
    (uneven dispatch, plan/expert_load.py), default balanced."""
    start = time.perf_counter()
    router = cluster_router(cluster, gpus)
    if fidelity == "analytical" and congestion != "none":
        raise ConfigError(f"--congestion {congestion}: the analytical path has no shared links to control; use "
                          "--fidelity flow, hybrid or aggregate")
    clock = {"simulate": 0.0}

    def play(slice_order: list[int] | None = None, steps: int = 0,
             push_orders: dict[int, list[int]] | None = None) -> tuple[Workload, SimResult]:
        workload = build_workload(config, gpus, cluster, efficiency, fidelity, vocab_size, router, expert_load,
                                  slice_order, steps, push_orders)
        network = DedicatedNetwork(router) if fidelity == "analytical" else flow_network(router, congestion)
        cores, shared = shared_cores(config, workload, cluster)
        built = time.perf_counter()
        result = simulate(workload.programs, network, record_spans, cores, shared)
        clock["simulate"] += time.perf_counter() - built
        return workload, result

    workload, result = play()
    passes = 0
    if workload.server_ranks:  # asynchronous parameter servers: the workers' steady state, pushes as they arrive
        workload, result, passes = asynchronous.steady_state(play, workload, result)
    elif workload.steps > 1:  # the priority schedule: its steady state, in the order the runtime's rule picks
        workload, result, passes = steady_state(play, workload, result)
    built = time.perf_counter() - start - clock["simulate"]  # the router, the workloads, the order
    return StepRun(workload, router.topology, result, built, clock["simulate"], passes)
