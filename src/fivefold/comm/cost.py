"""Alpha-beta-gamma cost model of the collectives in comm/ (Hockney 1994; Thakur et al. 2005; Chan et al. 2007).

A link is (alpha: seconds per message, beta: seconds per byte, gamma: seconds per byte reduced).
A cluster has an intra-node link and an inter-node link and `node_size` ranks per node. A flat
algorithm over ranks on several nodes is paced by its slowest link, the inter-node one; the
two-level algorithms put their row phases on the intra-node link and the column phase on the
inter-node link. `predict(algorithm, n, p, cluster)` gives the time of an all-reduce of n bytes;
`best_all_reduce` is the `auto` choice; `fit_link` fits alpha and beta to measured (bytes,
seconds) pairs by least squares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.comm.tree import DEFAULT_CHUNK_ELEMENTS
from fivefold.comm.two_level import torus_shape


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # seconds per byte
    gamma: float = 0.0  # seconds per byte reduced

    def message(self, n: float) -> float:
        return self.alpha + n * self.beta


@dataclass(frozen=True)
class Cluster:
    intra: Link
    inter: Link
    node_size: int

    def link_for(self, p: int) -> Link:
        """The link pacing a flat algorithm over p consecutive ranks."""
        return self.intra if p <= self.node_size else self.inter


def _folded(p: int) -> tuple[int, bool]:
    power = 1 << (p.bit_length() - 1)
    return power, power != p


def ring(n: float, p: int, link: Link) -> float:
    if p == 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n * link.beta + (p - 1) / p * n * link.gamma


def halving_doubling(n: float, p: int, link: Link) -> float:
    if p == 1:
        return 0.0
    power, folded = _folded(p)
    steps = math.log2(power)
    core = 2 * steps * link.alpha + 2 * (power - 1) / power * n * link.beta + (power - 1) / power * n * link.gamma
    return core + (2 * link.message(n) + n * link.gamma if folded else 0.0)


rabenseifner = halving_doubling


def butterfly(n: float, p: int, link: Link) -> float:
    if p == 1:
        return 0.0
    power, folded = _folded(p)
    core = math.log2(power) * (link.message(n) + n * link.gamma)
    return core + (2 * link.message(n) + n * link.gamma if folded else 0.0)


def tree(n: float, p: int, link: Link, element_bytes: int = 4, halves: int = 1) -> float:
    """Pipelined binary tree(s): `halves` trees each carrying n / halves in k chunks."""
    if p == 1:
        return 0.0
    part = n / halves
    k = max(1, math.ceil(part / element_bytes / DEFAULT_CHUNK_ELEMENTS))
    depth = int(math.log2(p))
    # per pipeline step an inner rank takes two children's chunks on its incoming link and adds them
    return (2 * depth + k - 1) * (link.alpha + 2 * part / k * link.beta) + 2 * part * link.gamma


def double_tree(n: float, p: int, link: Link, element_bytes: int = 4) -> float:
    return tree(n, p, link, element_bytes, halves=2)


def two_level(n: float, p: int, inner: int, inner_link: Link, outer_link: Link, outer=None) -> float:
    rows = p // inner
    within = ring(n, inner, inner_link)  # reduce-scatter + all-gather inside a row = a ring all-reduce's cost
    return within + (outer or halving_doubling)(n / inner, rows, outer_link)


def predict(algorithm: str, n: float, p: int, cluster: Cluster) -> float:
    """Predicted seconds of an all-reduce of n bytes over p ranks (ranks laid out node by node)."""
    flat = cluster.link_for(p)
    if algorithm == "ring":
        return ring(n, p, flat)
    if algorithm in ("halving_doubling", "rabenseifner"):
        return halving_doubling(n, p, flat)
    if algorithm == "butterfly":
        return butterfly(n, p, flat)
    if algorithm == "tree":
        return tree(n, p, flat)
    if algorithm == "double_tree":
        return double_tree(n, p, flat)
    if algorithm == "hierarchical":
        inner = cluster.node_size if p % cluster.node_size == 0 else p
        return two_level(n, p, inner, cluster.intra, cluster.inter)
    if algorithm == "torus":
        row, _ = torus_shape(p)
        return two_level(n, p, row, cluster.link_for(row), cluster.link_for(p), outer=ring)
    raise ValueError(f"no cost formula for {algorithm!r}")


def best_all_reduce(n: float, p: int, cluster: Cluster, candidates: tuple[str, ...] | None = None) -> str:
    """The `auto` choice: the algorithm with the smallest predicted time."""
    from fivefold.comm import ALL_REDUCE

    names = candidates or tuple(ALL_REDUCE)
    return min(names, key=lambda name: (predict(name, n, p, cluster), name))


def fit_link(sizes: list[float], seconds: list[float]) -> Link:
    """Least-squares alpha and beta of t = alpha + n beta from one-way message times."""
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("fitting alpha and beta needs times at two or more message sizes")
    count = len(sizes)
    mean_n, mean_t = sum(sizes) / count, sum(seconds) / count
    covariance = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, seconds))
    variance = sum((n - mean_n) ** 2 for n in sizes)
    beta = covariance / variance
    return Link(alpha=max(mean_t - beta * mean_n, 0.0), beta=max(beta, 0.0))
