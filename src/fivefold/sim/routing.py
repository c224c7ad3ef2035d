"""Routing of flows over a topology's least-cost routes: ECMP, ECMP with path variation, packet spraying.

    ecmp        every switch hashes the flow's identity (source, destination, flow key) and takes
                that one of its equal-cost next hops: the whole flow follows one path, and two
                elephant flows that hash alike share a link while another lies idle (Al-Fares et
                al. 2008; Hopps, RFC 2992).
    ecmp_paths  "enhanced ECMP with path variation": the message is cut into `subflows` flows
                with different keys (as NCCL's several queue pairs per connection, or a varied
                source port), each hashed on its own, so a collision costs a fraction of the flow.
    spray       per-packet spraying: at every switch the flow splits evenly over its equal-cost
                next hops; at flow level a link carries the fraction of the flow that reaches it.

A route is a tuple of (link index, fraction of the flow's rate the link carries); ECMP routes
carry 1.0 on each link of one path.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass

from fivefold.errors import ConfigError
from fivefold.sim.names import ROUTINGS
from fivefold.sim.topology import Topology

Route = tuple[tuple[int, float], ...]


def flow_hash(seed: int, source: int, destination: int, key: object, vertex: int) -> int:
    """The stable hash a switch at `vertex` applies to a flow (the same in every run and process).

    blake2b rather than a CRC: a CRC is linear, so the low bits of flows whose identities differ
    in a digit or two are correlated, and 8 flows mod 4 paths always collided alike."""
    digest = hashlib.blake2b(f"{seed}/{source}/{destination}/{key}/{vertex}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class Router:
    topology: Topology
    policy: str = "ecmp"
    subflows: int = 1  # ecmp_paths: flows per message
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ROUTINGS:
            raise ConfigError(f"topology.routing = {self.policy!r}: use one of {', '.join(ROUTINGS)}")
        if self.policy == "ecmp_paths" and self.subflows < 2:
            raise ConfigError(f"topology.subflows = {self.subflows}: ecmp_paths needs 2 or more subflows per message")
        self._sprayed: dict[tuple[int, int], Route] = {}

    def split(self, source: int, destination: int, key: object) -> list[tuple[object, float]]:
        """The flows a message becomes: (flow key, share of the bytes)."""
        if self.policy == "ecmp_paths":
            return [((key, j), 1 / self.subflows) for j in range(self.subflows)]
        return [(key, 1.0)]

    def route(self, source: int, destination: int, key: object) -> Route:
        if source == destination:
            return ()
        if self.policy == "spray":
            if (source, destination) not in self._sprayed:
                self._sprayed[(source, destination)] = self._spray(source, destination)
            return self._sprayed[(source, destination)]
        links, vertex = [], source
        while vertex != destination:
            hops = self.topology.equal_cost_next_hops(vertex, destination)
            link = hops[flow_hash(self.seed, source, destination, key, vertex) % len(hops)] if len(hops) > 1 else hops[0]
            links.append((link, 1.0))
            vertex = self.topology.links[link].target
        return tuple(links)

    def _spray(self, source: int, destination: int) -> Route:
        distance = self.topology.distances_to(destination)
        share = {source: 1.0}
        carried: dict[int, float] = {}
        # Every link of a least-cost route lowers the distance, so visiting vertices from the
        # farthest to the nearest passes each one's whole share on at once.
        queue = [(-distance[source], source)]
        while queue:
            _, vertex = heapq.heappop(queue)
            if vertex == destination:
                continue
            amount = share.pop(vertex)
            hops = self.topology.equal_cost_next_hops(vertex, destination)
            for link in hops:
                carried[link] = carried.get(link, 0.0) + amount / len(hops)
                target = self.topology.links[link].target
                if target not in share:
                    heapq.heappush(queue, (-distance[target], target))
                share[target] = share.get(target, 0.0) + amount / len(hops)
        return tuple(sorted(carried.items()))

    def path_latency(self, route: Route) -> float:
        """Latency of the route: the sum over its links, weighted by the share each carries (a path's sum for ECMP)."""
        return sum(self.topology.links[link].latency * fraction for link, fraction in route)


def cluster_router(cluster, accelerators: int) -> Router:
    """The fabric of `cluster` (plan/cluster.py ClusterSpec) for `accelerators` ranks, routed as its
    [topology] table says: what every simulation here runs over."""
    from fivefold.sim.topology import build_topology

    spec = cluster.topology
    return Router(build_topology(cluster, accelerators), spec.routing, spec.subflows, spec.seed)
