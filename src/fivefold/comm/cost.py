"""Alpha-beta-gamma cost model of the collectives in comm/ (Hockney 1994; Thakur et al. 2005; Chan et al. 2007).

A link is (alpha: seconds per message, beta: seconds per byte, gamma: seconds per byte reduced).
A cluster has an intra-node link and an inter-node link and `node_size` ranks per node. A flat
algorithm over ranks on several nodes is paced by its slowest link, the inter-node one; the
two-level algorithms put their row phases on the intra-node link and the column phase on the
inter-node link. `predict(algorithm, n, p, cluster)` gives the time of an all-reduce of n bytes;
`best_all_reduce` is the `auto` choice; `fit_link` fits alpha and beta to measured (bytes,
seconds) pairs by least squares. `predict_collective` covers the other collectives
(reduce-scatter, all-gather, broadcast, all-to-all) that `fivefold bench comm` measures.

`uneven_all_to_all` prices an expert dispatch from the exact bytes per rank pair (`dispatch_bytes`,
from the routing counts), which the runtime's own byte count is tested against.

`native_collective` prices the backend's own collectives (gloo's, NCCL's) in the ring form
(all-reduce 2(p-1) messages of n/p, reduce-scatter / all-gather / all-to-all p-1 of them) on a link
that `fit_native_link` fits to that collective's measured times, so a planner cluster file can
carry one effective link per collective where the backend's implementation is slower or faster
than point-to-point messages predict. Where the link also carries the collective's measured times
at the ranks they were timed over (`Link.measured`), it reads those instead, interpolated between
the measured sizes (`measured_seconds`): a straight line through them misses where they bend.

`traffic` gives the model's count of what the busiest rank sends (messages, bytes): the
coefficients of alpha and beta in the formulas above for the non-pipelined algorithms. Tests count
the messages the runtime really posts and compare.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fivefold.comm.tree import DEFAULT_CHUNK_ELEMENTS
from fivefold.comm.two_level import torus_shape


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # seconds per byte
    gamma: float = 0.0  # seconds per byte reduced
    # a backend collective's own times, (bytes, seconds) ascending, measured over `ranks` ranks: at that
    # many ranks native_collective reads them rather than the straight alpha-beta line fitted through them
    measured: tuple[tuple[float, float], ...] = ()
    ranks: int = 0
    # its times over groups of fewer ranks, every such group of the `ranks` running it at once (a layout's tensor-
    # or data-parallel groups inside the world), as (group ranks, ((bytes, seconds), ...)): read at that group size
    subgroups: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()

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



def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw / algbw (doc/PERFORMANCE.md there): what each rank's link carries per byte of the vector."""
    if collective == "all_reduce":
        return 2 * (p - 1) / p
    if collective == "broadcast":
        return 1.0
    return (p - 1) / p


def all_reduce_bytes(nbytes: int, p: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of nbytes."""
    return 2 * (p - 1) * nbytes // p


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


def fit_link(sizes: list[float], seconds: list[float], relative: bool = False) -> Link:
    """Least-squares alpha and beta of t = alpha + n beta from one-way message times.

    relative: minimise the squared *relative* errors (weights 1 / t^2), so that sizes spanning
    decades all count; plain least squares is ruled by the largest messages and can miss the
    small ones' cost by several times.
    """
    if len(sizes) < 2 or len(set(sizes)) < 2:
        raise ValueError("fitting alpha and beta needs times at two or more message sizes")
    weights = [1 / max(t, 1e-12) ** 2 if relative else 1.0 for t in seconds]
    total = sum(weights)
    mean_n = sum(w * n for w, n in zip(weights, sizes)) / total
    mean_t = sum(w * t for w, t in zip(weights, seconds)) / total
    covariance = sum(w * (n - mean_n) * (t - mean_t) for w, n, t in zip(weights, sizes, seconds))
    variance = sum(w * (n - mean_n) ** 2 for w, n in zip(weights, sizes))
    beta = covariance / variance
    return Link(alpha=max(mean_t - beta * mean_n, 0.0), beta=max(beta, 0.0))


def _log2(p: int) -> int:
    return p.bit_length() - 1


def reduce_scatter(algorithm: str, n: float, p: int, link: Link) -> float:
    if p == 1:
        return 0.0
    if algorithm == "ring":
        return (p - 1) * link.alpha + (p - 1) / p * n * (link.beta + link.gamma)
    power, folded = _folded(p)
    core = _log2(power) * link.alpha + (power - 1) / power * n * (link.beta + link.gamma)
    return core + (link.message(n) + n * link.gamma + link.message(n / p) if folded else 0.0)


def all_gather(algorithm: str, n: float, p: int, link: Link) -> float:
    if p == 1:
        return 0.0
    if algorithm == "ring":
        return (p - 1) * link.alpha + (p - 1) / p * n * link.beta
    power, folded = _folded(p)
    core = _log2(power) * link.alpha + (power - 1) / power * n * link.beta
    return core + (link.message(n / p) + link.message(n) if folded else 0.0)


def broadcast(algorithm: str, n: float, p: int, link: Link, element_bytes: int = 4) -> float:
    if p == 1:
        return 0.0
    if algorithm == "binomial":
        return math.ceil(math.log2(p)) * link.message(n)
    k = max(1, math.ceil(n / element_bytes / DEFAULT_CHUNK_ELEMENTS))
    return (p - 2 + k) * link.message(n / k)


def all_to_all(n: float, p: int, link: Link) -> float:
    return (p - 1) * link.message(n / p)


def dispatch_bytes(counts: list[list[int]], experts_per_rank: int, row_bytes: int) -> list[list[int]]:
    """Bytes rank i sends rank j in an expert dispatch: counts[i][e] rows from rank i to expert e, held by
    rank e // experts_per_rank (the combine sends the transpose back)."""
    p = len(counts)
    out = [[0] * p for _ in range(p)]
    for i, row in enumerate(counts):
        for e, rows in enumerate(row):
            out[i][e // experts_per_rank] += rows * row_bytes
    return out


def uneven_all_to_all(matrix: Sequence[Sequence[int]], link: Link) -> float:
    """Pairwise exchange of an uneven all-to-all, matrix[i][j] the bytes rank i sends rank j.

    Step k, rank i sends to i + k and receives from i - k; a step costs a rank alpha plus the beta of
    its larger message (send and receive overlap), an empty step nothing. The slowest rank sets the time.
    """
    p = len(matrix)
    worst = 0.0
    for i in range(p):
        total = 0.0
        for k in range(1, p):
            largest = max(matrix[i][(i + k) % p], matrix[(i - k) % p][i])
            if largest:
                total += link.message(largest)
        worst = max(worst, total)
    return worst


def predict_collective(collective: str, algorithm: str, n: float, p: int, cluster: Cluster) -> float:
    """Predicted seconds of one collective over n bytes (a rank's whole vector) with the named algorithm."""
    link = cluster.link_for(p)
    if collective == "all_reduce":
        return predict(algorithm, n, p, cluster)
    if collective == "reduce_scatter":
        return reduce_scatter(algorithm, n, p, link)
    if collective == "all_gather":
        return all_gather(algorithm, n, p, link)
    if collective == "broadcast":
        return broadcast(algorithm, n, p, link)
    if collective == "all_to_all":
        return all_to_all(n, p, link)
    raise ValueError(f"no cost formula for collective {collective!r}")


NATIVE_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def ring_form(collective: str, p: int) -> tuple[int, float]:
    """(messages, bytes per byte of the vector) the busiest rank sends in the ring form of `collective`."""
    if collective == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return p - 1, (p - 1) / p
    raise ValueError(f"no ring form for collective {collective!r}; use one of {', '.join(NATIVE_COLLECTIVES)}")


def native_collective(collective: str, n: float, p: int, link: Link) -> float:
    """Seconds of the backend's `collective` over n bytes (a rank's whole vector) in the ring form, or, where the
    link carries the collective's measured times at p ranks (over the world it was measured on, or over its groups
    of p, `Link.subgroups`), those times interpolated (`measured_seconds`). On a CPU host whose cores the ranks
    share, a pair's call inside four ranks is not a two-rank world's: its peers wait on the other ranks' compute
    too (2026-11-29: 1.2-1.6x the ring form's line from the four-rank fit at 256 KB-4 MB)."""
    if p == 1:
        return 0.0
    messages, volume = ring_form(collective, p)

    def line(size: float) -> float:
        return messages * link.alpha + volume * size * link.beta

    if link.measured and p == link.ranks:
        return measured_seconds(link.measured, n, line)
    for ranks, points in link.subgroups:
        if p == ranks:
            return measured_seconds(points, n, line)
    return line(n)


def measured_seconds(points: tuple[tuple[float, float], ...], n: float, line) -> float:
    """Seconds of n bytes from measured (bytes, seconds) points, ascending: linear between the two around n;
    beyond them the fitted line's slope from the nearest point (never below the smaller of that point and
    the line). A line through all the points misses where the times bend: gloo's all-reduce on this 2-core
    machine took 0.4 ms at 16 KB, 1.7-2.4 ms at 512 KB and 4-4.5 ms at 4 MB, where the least-squares
    line through 16 KB-4 MB gave 1.0-1.2 ms at 512 KB. The points are read through `nondecreasing` first: more
    bytes cannot take less time, so a time below a smaller size's is a noisy mean."""
    points = nondecreasing(points)
    sizes = [size for size, _ in points]
    if n <= sizes[0] or n >= sizes[-1]:
        size, seconds = points[0] if n <= sizes[0] else points[-1]
        return max(seconds + line(n) - line(size), min(seconds, line(n)))
    i = bisect.bisect_right(sizes, n)
    (a, ta), (b, tb) = points[i - 1], points[i]
    return ta + (tb - ta) * (n - a) / (b - a)


@functools.lru_cache(maxsize=256)
def nondecreasing(points: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    """The least-squares nondecreasing fit of the times (pool adjacent violators: a run of points whose times fall
    is replaced by their mean), sizes kept. A mean of 20 calls of a gloo collective on shared cores can land on a
    stall: one run of this machine measured 2-rank all-reduces of 256 KB, 512 KB and 1 MB at 3.18, 1.24 and
    2.21 ms; read as 2.21 ms each, 512 KB no longer prices below 256 KB."""
    blocks: list[list[float]] = []  # [sum of times, count]
    for _, seconds in points:
        blocks.append([seconds, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    times = [total / count for total, count in blocks for _ in range(int(count))]
    return tuple((size, t) for (size, _), t in zip(points, times))


def fit_native_link(collective: str, p: int, sizes: list[float], seconds: list[float]) -> Link:
    """The link on which `native_collective` reproduces measured (bytes, seconds) at p ranks, by least squares."""
    messages, volume = ring_form(collective, p)
    return fit_link([volume * n / messages for n in sizes], [t / messages for t in seconds], relative=True)


def _tree_links(p: int, position: int) -> int:
    """Messages a heap-ordered binary tree's node sends per chunk of an all-reduce: up to its parent, down to its children."""
    return int(position > 0) + sum(1 for child in (2 * position + 1, 2 * position + 2) if child < p)


def _tree_traffic(n: float, p: int, double: bool, element_bytes: int) -> tuple[int, float]:
    """Pipelined (double) binary tree all-reduce: per rank, each chunk goes up once and down to each child.

    The double tree runs the first half of the vector on the tree and the second on its mirror
    (rank p-1-q at position q), so interior nodes of one are leaves of the other (NCCL's double tree).
    """
    elements = int(n // element_bytes)
    halves = [(0, elements // 2, False), (elements // 2, elements, True)] if double else [(0, elements, False)]
    busiest = (0.0, 0)
    for rank in range(p):
        sent, messages = 0.0, 0
        for lo, hi, mirrored in halves:
            if hi <= lo:
                continue
            links = _tree_links(p, p - 1 - rank if mirrored else rank)
            sent += links * (hi - lo) * element_bytes
            messages += links * math.ceil((hi - lo) / DEFAULT_CHUNK_ELEMENTS)
        busiest = max(busiest, (sent, messages))
    return busiest[1], busiest[0]


def traffic(collective: str, algorithm: str, n: int, p: int, node_size: int = 0,
            element_bytes: int = 4) -> tuple[int, float]:
    """(messages, bytes) the busiest rank sends, as the formulas count them (n divisible by p)."""
    if p == 1:
        return 0, 0.0
    if collective == "all_reduce" and algorithm in ("tree", "double_tree"):
        return _tree_traffic(n, p, algorithm == "double_tree", element_bytes)
    power, folded = _folded(p)
    steps = _log2(power)
    if collective == "all_reduce":
        if algorithm == "ring":
            return 2 * (p - 1), 2 * (p - 1) / p * n
        if algorithm in ("halving_doubling", "rabenseifner"):
            return 2 * steps + folded, 2 * (power - 1) / power * n + folded * n
        if algorithm == "butterfly":
            return steps + folded, (steps + folded) * n
        if algorithm in ("hierarchical", "torus"):
            inner = node_size if algorithm == "hierarchical" else torus_shape(p)[0]
            outer = "rabenseifner" if algorithm == "hierarchical" else "ring"
            messages, sent = traffic("all_reduce", outer, n // inner, p // inner)
            return 2 * (inner - 1) + messages, 2 * (inner - 1) / inner * n + sent
    if collective in ("reduce_scatter", "all_gather"):
        if algorithm == "ring":
            return p - 1, (p - 1) / p * n
        if not folded:
            return steps, (power - 1) / power * n
    if collective == "broadcast" and algorithm == "binomial":
        return math.ceil(math.log2(p)), math.ceil(math.log2(p)) * n
    if collective == "all_to_all":
        return p - 1, (p - 1) / p * n
    raise ValueError(f"no traffic count for {collective} {algorithm} at p = {p}")
