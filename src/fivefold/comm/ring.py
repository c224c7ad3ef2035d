"""Ring collectives (Patarasuk & Yuan 2009; the bandwidth-optimal all-reduce of Baidu, Horovod, NCCL).

p ranks in a ring, the vector cut into p chunks (chunk_bounds). Reduce-scatter: in step s each
rank sends one chunk to its right neighbour and adds the chunk arriving from its left one; after
p - 1 steps rank i holds chunk i summed over all ranks. All-gather: the same p - 1 steps, copying
instead of adding. All-reduce = reduce-scatter + all-gather.

Cost (alpha latency, beta seconds per byte, gamma seconds per byte reduced, n bytes):
    reduce-scatter, all-gather   (p-1) alpha + (p-1)/p n beta   (+ (p-1)/p n gamma to reduce)
    all-reduce                   2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
Bandwidth-optimal, latency linear in p.
"""

from __future__ import annotations

import torch

from fivefold.comm.p2p import Ranks, chunk_bounds, exchange


def ring_reduce_scatter(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Sum `flat` over the ranks, in place, leaving rank i's chunk i complete; returns that chunk."""
    p, i = ranks.size, ranks.index
    bounds = chunk_bounds(flat.numel(), p)
    for step in range(p - 1):
        send_lo, send_hi = bounds[(i - step - 1) % p]
        recv_lo, recv_hi = bounds[(i - step - 2) % p]
        incoming = torch.empty(recv_hi - recv_lo, dtype=flat.dtype, device=flat.device)
        exchange(flat[send_lo:send_hi], i + 1, incoming, i - 1, ranks)
        flat[recv_lo:recv_hi] += incoming
    lo, hi = bounds[i]
    return flat[lo:hi]


def ring_all_gather(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Rank i contributes chunk i of `flat`; afterwards every rank holds every chunk (in place)."""
    p, i = ranks.size, ranks.index
    bounds = chunk_bounds(flat.numel(), p)
    for step in range(p - 1):
        send_lo, send_hi = bounds[(i - step) % p]
        recv_lo, recv_hi = bounds[(i - step - 1) % p]
        exchange(flat[send_lo:send_hi], i + 1, flat[recv_lo:recv_hi], i - 1, ranks)
    return flat


def ring_all_reduce(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Sum over the ranks, in place: ring reduce-scatter, then ring all-gather."""
    if ranks.size > 1:
        ring_reduce_scatter(flat, ranks)
        ring_all_gather(flat, ranks)
    return flat
