"""Measuring the links the cost model describes: timed exchanges between two ranks, fitted to alpha and beta.

`exchange_times(ranks, a, b, sizes)` has positions a and b swap messages of each size (a send and
a receive posted together, `p2p.exchange`, the step every algorithm in comm/ is made of) back to
back, as the collectives run them, and returns seconds per exchange; the other ranks wait. This
is a bidirectional ping-pong (OSU's osu_bibw pattern): it measures the primitive the formulas
count, with its software overhead, which on a shared CPU is most of alpha. `measure_cluster` fits
an intra-node link on ranks 0 and 1 and, when the ranks span several nodes, an inter-node link on
ranks 0 and node_size, plus gamma from timing a local sum; the first rank's figures are broadcast
so every rank builds the same `Cluster` (the `auto` all-reduce choice must agree everywhere).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fivefold.comm.cost import Cluster, Link, fit_link
from fivefold.comm.p2p import Ranks, exchange

DEFAULT_SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)  # bytes


def exchange_times(ranks: Ranks, a: int, b: int, sizes: tuple[int, ...] = DEFAULT_SIZES,
                   repeats: int = 20) -> list[float]:
    """Seconds per exchange of each message size between positions a and b (zeros on other ranks)."""
    me = ranks.index
    times = []
    for nbytes in sizes:
        outgoing = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        incoming = torch.empty_like(outgoing)
        calls = max(3, min(repeats, (64 << 20) // max(nbytes, 1)))
        if me in (a, b):
            peer = b if me == a else a
            exchange(outgoing, peer, incoming, peer, ranks)  # warm the connection up
            start = time.perf_counter()
            for _ in range(calls):
                exchange(outgoing, peer, incoming, peer, ranks)
            times.append((time.perf_counter() - start) / calls)
        else:
            times.append(0.0)
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
    intra = fit_link(list(sizes), exchange_times(ranks, 0, 1, sizes), relative=True) if p > 1 else Link(0.0, 0.0)
    inter = fit_link(list(sizes), exchange_times(ranks, 0, node_size, sizes), relative=True) if node_size < p else intra
    figures = torch.tensor([intra.alpha, intra.beta, inter.alpha, inter.beta, gamma], dtype=torch.float64)
    dist.broadcast(figures, ranks.global_rank(0), group=ranks.group)
    a1, b1, a2, b2, g = figures.tolist()
    return Cluster(Link(a1, b1, g), Link(a2, b2, g), node_size)
