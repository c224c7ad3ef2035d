"""Network topologies for the cluster simulator: accelerators, switches and the directed links between them.

A `Topology` is a directed graph. Its first `accelerators` vertices are the accelerators (global
rank r is vertex r); the rest are switches. Every cable is two directed links (full duplex), each
with a bandwidth in bytes/s, a latency in seconds and an integer routing cost. Routes follow the
least total cost, so a message between two GPUs of one node takes NVLink (cost 1 per hop) rather
than the NICs (cost 10 per hop). Only switches forward traffic, except on a torus, where the
accelerators are the routers.

Builders, one per fabric the literature uses:

    nvswitch        one node: every accelerator linked to one NVSwitch
    fat_tree        nodes of NVSwitch-connected GPUs; one NIC per GPU into a leaf switch shared by
                    `nodes_per_leaf` nodes; every leaf linked to every spine; uplinks thinned by
                    the oversubscription ratio (1 = full bisection)
    rail_optimized  as fat_tree, but NIC k of every node goes to rail leaf k of its group, so
                    GPUs with the same local index meet one switch hop apart (DGX SuperPOD)
    torus_2d        an X x Y grid of accelerators, each linked to its four neighbours with
                    wrap-around (TPU-style), no switches

`equal_cost_next_hops(vertex, destination)` gives the links leaving `vertex` on least-cost routes
to `destination`: routing.py hashes among them (ECMP) or splits across them (spraying).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from fivefold.errors import ConfigError

NVLINK_COST = 1
NETWORK_COST = 10


@dataclass(frozen=True)
class Link:
    source: int
    target: int
    bandwidth: float  # bytes per second
    latency: float  # seconds
    cost: int = 1  # routing metric


@dataclass
class Topology:
    name: str
    accelerators: int
    vertex_names: list[str]
    links: list[Link] = field(default_factory=list)
    _out: list[list[int]] = field(default_factory=list, repr=False)
    _into: list[list[int]] = field(default_factory=list, repr=False)
    _distance: dict[int, list[float]] = field(default_factory=dict, repr=False)
    _next_hops: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._out = [[] for _ in self.vertex_names]
        self._into = [[] for _ in self.vertex_names]
        links, self.links = self.links, []
        for link in links:
            self._add(link)

    def _add(self, link: Link) -> None:
        self._out[link.source].append(len(self.links))
        self._into[link.target].append(len(self.links))
        self.links.append(link)
        self._distance.clear()
        self._next_hops.clear()

    def add_vertex(self, name: str) -> int:
        self.vertex_names.append(name)
        self._out.append([])
        self._into.append([])
        return len(self.vertex_names) - 1

    def connect(self, a: int, b: int, bandwidth: float, latency: float, cost: int = 1) -> None:
        """A full-duplex cable: one link each way, each with the whole bandwidth."""
        self._add(Link(a, b, bandwidth, latency, cost))
        self._add(Link(b, a, bandwidth, latency, cost))

    def distances_to(self, destination: int) -> list[float]:
        """Least routing cost from every vertex to `destination` (Dijkstra over reversed links), cached."""
        if destination not in self._distance:
            distance = [float("inf")] * len(self.vertex_names)
            distance[destination] = 0
            queue = [(0, destination)]
            while queue:
                d, v = heapq.heappop(queue)
                if d > distance[v]:
                    continue
                if v < self.accelerators and v != destination and not self.direct:
                    continue  # only switches forward, except on a torus
                for index in self._into[v]:
                    link = self.links[index]
                    nd = d + link.cost
                    if nd < distance[link.source]:
                        distance[link.source] = nd
                        heapq.heappush(queue, (nd, link.source))
            self._distance[destination] = distance
        return self._distance[destination]

    @property
    def direct(self) -> bool:
        """Whether accelerators forward traffic themselves (a torus); else only switches forward."""
        return self.accelerators == len(self.vertex_names)

    def equal_cost_next_hops(self, vertex: int, destination: int) -> list[int]:
        """Indices of the links out of `vertex` that lie on least-cost routes to `destination`."""
        key = (vertex, destination)
        if key not in self._next_hops:
            self._next_hops[key] = self._equal_cost_next_hops(vertex, destination)
        return self._next_hops[key]

    def _equal_cost_next_hops(self, vertex: int, destination: int) -> list[int]:
        distance = self.distances_to(destination)
        if distance[vertex] == float("inf"):
            raise ValueError(f"{self.vertex_names[destination]} cannot be reached from {self.vertex_names[vertex]}")
        return [index for index in self._out[vertex]
                if distance[self.links[index].target] + self.links[index].cost == distance[vertex]
                and (self.direct or self.links[index].target == destination
                     or self.links[index].target >= self.accelerators)]

    def describe(self) -> str:
        switches = len(self.vertex_names) - self.accelerators
        return f"{self.name}: {self.accelerators} accelerators, {switches} switches, {len(self.links)} links"


def _check(value: int, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"topology.{name} = {value!r}: must be an integer >= {low}")
    return value


def nvswitch(accelerators: int, bandwidth: float, latency: float) -> Topology:
    """One node: each accelerator has one full-duplex link of `bandwidth` into an NVSwitch.

    `latency` is the accelerator-to-accelerator message latency; each of the two hops takes half.
    """
    _check(accelerators, "accelerators_per_node")
    topology = Topology("nvswitch", accelerators, [f"gpu{r}" for r in range(accelerators)])
    switch = topology.add_vertex("nvswitch")
    for r in range(accelerators):
        topology.connect(r, switch, bandwidth, latency / 2, NVLINK_COST)
    return topology


def _nodes_with_nvswitch(name: str, nodes: int, per_node: int, nvlink: float, nvlink_latency: float) -> Topology:
    topology = Topology(name, nodes * per_node, [f"gpu{r}" for r in range(nodes * per_node)])
    if per_node > 1:
        for node in range(nodes):
            switch = topology.add_vertex(f"node{node}.nvswitch")
            for local in range(per_node):
                topology.connect(node * per_node + local, switch, nvlink, nvlink_latency / 2, NVLINK_COST)
    return topology


def fat_tree(nodes: int, per_node: int, nvlink: float, nvlink_latency: float, nic: float, nic_latency: float,
             nodes_per_leaf: int = 4, spines: int = 0, oversubscription: float = 1.0) -> Topology:
    """A two-level (leaf-spine) fat tree of nodes; every GPU's NIC goes into its node group's leaf.

    Each leaf has `nodes_per_leaf * per_node` NIC ports down and one uplink to each of `spines`
    spines (default: down ports / oversubscription, so each uplink runs at NIC speed, as when a
    fabric is oversubscribed by leaving out spines); the uplinks together carry down capacity /
    oversubscription. Network latency is split evenly over the (up to four) network hops of a route.
    """
    for value, name in ((nodes, "nodes"), (per_node, "accelerators_per_node"), (nodes_per_leaf, "nodes_per_leaf")):
        _check(value, name)
    if oversubscription < 1:
        raise ConfigError(f"topology.oversubscription = {oversubscription}: must be >= 1 (1 = full bisection)")
    topology = _nodes_with_nvswitch("fat_tree", nodes, per_node, nvlink, nvlink_latency)
    leaves = -(-nodes // nodes_per_leaf)
    ports = nodes_per_leaf * per_node
    spines = spines or max(1, round(ports / oversubscription))
    leaf_ids = [topology.add_vertex(f"leaf{j}") for j in range(leaves)]
    hop = nic_latency / 4
    for r in range(nodes * per_node):
        topology.connect(r, leaf_ids[r // per_node // nodes_per_leaf], nic, hop, NETWORK_COST)
    if leaves > 1:
        uplink = ports * nic / oversubscription / spines
        spine_ids = [topology.add_vertex(f"spine{k}") for k in range(spines)]
        for leaf in leaf_ids:
            for spine in spine_ids:
                topology.connect(leaf, spine, uplink, hop, NETWORK_COST)
    return topology


def rail_optimized(nodes: int, per_node: int, nvlink: float, nvlink_latency: float, nic: float, nic_latency: float,
                   nodes_per_rail_group: int = 32, spines: int = 0, oversubscription: float = 1.0) -> Topology:
    """Rail-optimised fabric: NIC k of each node in a group of nodes goes into that group's rail-k leaf.

    GPUs with the same local index in one group are one leaf apart; traffic between rails or groups
    goes leaf-spine-leaf (NCCL's PXN, which would cross NVLink to the right rail first, is not
    modelled). Every leaf has one uplink to each of `spines` spines (default: its down ports /
    oversubscription, each at NIC speed); together they carry down capacity / oversubscription.
    """
    for value, name in ((nodes, "nodes"), (per_node, "accelerators_per_node"),
                        (nodes_per_rail_group, "nodes_per_leaf")):
        _check(value, name)
    if oversubscription < 1:
        raise ConfigError(f"topology.oversubscription = {oversubscription}: must be >= 1 (1 = full bisection)")
    topology = _nodes_with_nvswitch("rail_optimized", nodes, per_node, nvlink, nvlink_latency)
    groups = -(-nodes // nodes_per_rail_group)
    hop = nic_latency / 4
    leaves = {(g, k): topology.add_vertex(f"group{g}.rail{k}") for g in range(groups) for k in range(per_node)}
    for r in range(nodes * per_node):
        node, local = divmod(r, per_node)
        topology.connect(r, leaves[(node // nodes_per_rail_group, local)], nic, hop, NETWORK_COST)
    if len(leaves) > 1:
        spines = spines or max(1, round(nodes_per_rail_group / oversubscription))
        uplink = nodes_per_rail_group * nic / oversubscription / spines
        spine_ids = [topology.add_vertex(f"spine{k}") for k in range(spines)]
        for leaf in leaves.values():
            for spine in spine_ids:
                topology.connect(leaf, spine, uplink, hop, NETWORK_COST)
    return topology


def torus_2d(x: int, y: int, bandwidth: float, latency: float) -> Topology:
    """An x by y torus of accelerators (rank = row * x + column), each cable full duplex, `latency` per hop."""
    _check(x, "x")
    _check(y, "y")
    topology = Topology("torus_2d", x * y, [f"acc{r}" for r in range(x * y)])
    cables = set()
    for row in range(y):
        for column in range(x):
            here = row * x + column
            for there in (row * x + (column + 1) % x, ((row + 1) % y) * x + column):
                if there != here and (min(here, there), max(here, there)) not in cables:
                    cables.add((min(here, there), max(here, there)))
                    topology.connect(here, there, bandwidth, latency, 1)
    return topology


def build_topology(cluster, accelerators: int) -> Topology:
    """The fabric of `cluster` (a plan/cluster.py ClusterSpec, its [topology] table) for `accelerators` ranks.

    Links take the cluster's figures: NVLink = `intra` per GPU and direction, each NIC = `inter`;
    a torus cable takes `intra`. Rank r sits on node r // accelerators_per_node.
    """
    spec, per_node = cluster.topology, cluster.accelerators_per_node
    intra = (cluster.intra.bandwidth_gbs * 1e9, cluster.intra.latency_us * 1e-6)
    inter = (cluster.inter.bandwidth_gbs * 1e9, cluster.inter.latency_us * 1e-6)
    _check(accelerators, "accelerators")
    cluster.check_size(accelerators)
    if spec.kind == "nvswitch":
        if accelerators > per_node:
            raise ConfigError(f"topology.kind = nvswitch is one node of {per_node} accelerators, not {accelerators}: "
                              "use fat_tree or rail_optimized for several nodes")
        return nvswitch(accelerators, *intra)
    if spec.kind == "torus_2d":
        x, y = spec.torus
        if x * y != accelerators:
            raise ConfigError(f"topology.torus = [{x}, {y}] holds {x * y} accelerators, not {accelerators}: "
                              f"set torus to two factors of {accelerators}")
        return torus_2d(x, y, *intra)
    if accelerators <= per_node:  # part of one node: its switch is all a fat tree or rails would add
        return nvswitch(accelerators, *intra)
    nodes = -(-accelerators // per_node)
    if nodes * per_node != accelerators:
        raise ConfigError(f"{accelerators} ranks do not fill whole nodes of {per_node} accelerators: use a multiple "
                          f"of {per_node}")
    build = fat_tree if spec.kind == "fat_tree" else rail_optimized
    return build(nodes, per_node, *intra, *inter, spec.nodes_per_leaf, spec.spines, spec.oversubscription)
