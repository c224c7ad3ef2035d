"""Measuring the links the cost model describes: ping-pong between two ranks, fitted to alpha and beta.

`ping_pong(ranks, a, b, sizes)` times round trips of each message size between positions a and
b (the other ranks wait) and returns one-way seconds, half the median round trip, as the
OSU/Intel MPI benchmarks report latency. `measure_cluster` fits an intra-node link on ranks 0
and 1 and, when the ranks span several nodes, an inter-node link on ranks 0 and node_size, plus
gamma from timing a local sum; the first rank's figures are broadcast so every rank builds the
same `Cluster` (the `auto` all-reduce choice must agree everywhere).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from fivefold.comm.cost import Cluster, Link, fit_link
from fivefold.comm.p2p import Ranks

DEFAULT_SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)  # bytes


def ping_pong(ranks: Ranks, a: int, b: int, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 7) -> list[float]:
    """One-way seconds per message size between positions a and b (half the median round trip).

    Only a and b exchange messages; every rank returns the list (zeros on the others).
    """
    me = ranks.index
    times = []
    for nbytes in sizes:
        buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        trips = []
        for repeat in range(repeats + 1):  # the first round trip warms the connection up
            start = time.perf_counter()
            if me == a:
                dist.send(buffer, ranks.global_rank(b), group=ranks.group)
                dist.recv(buffer, ranks.global_rank(b), group=ranks.group)
            elif me == b:
                dist.recv(buffer, ranks.global_rank(a), group=ranks.group)
                dist.send(buffer, ranks.global_rank(a), group=ranks.group)
            if repeat:
                trips.append(time.perf_counter() - start)
        times.append(statistics.median(trips) / 2 if me in (a, b) else 0.0)
    return times


def measure_gamma(nbytes: int = 4 << 20, repeats: int = 5) -> float:
    """Seconds per byte of an in-place float32 sum on this machine."""
    x, y = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    x.add_(y)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.add_(y)
        best = min(best, time.perf_counter() - start)
    return best / nbytes


def measure_cluster(ranks: Ranks, node_size: int, sizes: tuple[int, ...] = DEFAULT_SIZES) -> Cluster:
    """Fit the intra- (and inter-) node link by ping-pong; the same Cluster on every rank."""
    p = ranks.size
    node_size = node_size if 0 < node_size <= p and p % node_size == 0 else p
    gamma = measure_gamma()
    intra = fit_link(list(sizes), ping_pong(ranks, 0, 1, sizes)) if p > 1 else Link(0.0, 0.0)
    inter = fit_link(list(sizes), ping_pong(ranks, 0, node_size, sizes)) if node_size < p else intra
    figures = torch.tensor([intra.alpha, intra.beta, inter.alpha, inter.beta, gamma], dtype=torch.float64)
    dist.broadcast(figures, ranks.global_rank(0), group=ranks.group)
    a1, b1, a2, b2, g = figures.tolist()
    return Cluster(Link(a1, b1, g), Link(a2, b2, g), node_size)
