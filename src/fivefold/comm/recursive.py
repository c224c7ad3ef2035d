"""Recursive collectives (Thakur, Rabenseifner & Gropp 2005): butterfly, halving-doubling, Rabenseifner.

    butterfly          recursive doubling: in step k, rank j swaps its whole vector with rank
                       j xor 2^k and adds. log2 p steps: latency-optimal, n bytes every step.
    halving_doubling   reduce-scatter by recursive vector halving with distance doubling (partner
                       j xor 1, then j xor 2, ...: the large early messages stay between near
                       ranks), then all-gather retracing the steps.
    rabenseifner       the same halving, with distance halving (partner j xor p/2 first), so rank
                       j ends with block j: Rabenseifner's algorithm, and our recursive
                       reduce-scatter and all-gather.

Non powers of two (p = 2^L + r): the first 2r ranks pair up; the even one of each pair hands its
vector (all-reduce) or its chunk (reduce-scatter) to the odd one, the 2^L remaining ranks run the
power-of-two algorithm, and the odd ranks hand the result back (Thakur et al.'s folding), for 2
extra steps.

Cost (p a power of two; folding adds 2 alpha + 2 n beta (all-reduce)):
    butterfly                        log2(p) (alpha + n beta + n gamma)
    halving_doubling, rabenseifner   2 log2(p) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
    recursive reduce-scatter / all-gather   log2(p) alpha + (p-1)/p n beta (+ gamma term)
"""

from __future__ import annotations

import torch

from fivefold.comm.p2p import Ranks, chunk_bounds, exchange, recv, send


def _core(ranks: Ranks) -> tuple[Ranks, int, int]:
    """The power-of-two core after folding: (core ranks, r folded pairs, 2^L)."""
    p = ranks.size
    power = 1 << (p.bit_length() - 1)
    folded = p - power
    members = tuple(ranks.members[j] for j in range(p) if j >= 2 * folded or j % 2 == 1)
    return ranks.subset(members), folded, power


def _in_core(index: int, folded: int) -> bool:
    return index >= 2 * folded or index % 2 == 1


def _halving_levels(j: int, power: int, bounds: list[tuple[int, int]], distance_doubling: bool):
    """(kept, sent, partner) element ranges of each halving step of core rank j, in order.

    With distance halving, segments are ranges of core ranks, split at their middle, so core rank
    j ends with `bounds[j]`; with distance doubling, element ranges are split in half.
    """
    levels = []
    if distance_doubling:
        lo, hi = bounds[0][0], bounds[-1][1]
        distance = 1
        while distance < power:
            mid = lo + (hi - lo) // 2
            lower = not j & distance
            kept, sent = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
            levels.append((kept, sent, j ^ distance))
            lo, hi = kept
            distance <<= 1
        return levels
    a, b = 0, power
    distance = power // 2
    while distance >= 1:
        mid = a + (b - a) // 2
        lower = j < mid
        low, high = (bounds[a][0], bounds[mid - 1][1]), (bounds[mid][0], bounds[b - 1][1])
        kept, sent = (low, high) if lower else (high, low)
        levels.append((kept, sent, j ^ distance))
        a, b = (a, mid) if lower else (mid, b)
        distance //= 2
    return levels


def _reduce_scatter_levels(flat: torch.Tensor, core: Ranks, levels) -> None:
    for (k_lo, k_hi), (s_lo, s_hi), partner in levels:
        incoming = torch.empty(k_hi - k_lo, dtype=flat.dtype, device=flat.device)
        exchange(flat[s_lo:s_hi], partner, incoming, partner, core)
        flat[k_lo:k_hi] += incoming


def _all_gather_levels(flat: torch.Tensor, core: Ranks, levels) -> None:
    for (k_lo, k_hi), (s_lo, s_hi), partner in reversed(levels):
        exchange(flat[k_lo:k_hi], partner, flat[s_lo:s_hi], partner, core)


def _fold_in(flat: torch.Tensor, ranks: Ranks, folded: int, part: tuple[int, int] | None = None) -> None:
    """Folded pairs: the even rank sends (its part of) the vector to the odd one, which adds it."""
    i = ranks.index
    lo, hi = part if part is not None else (0, flat.numel())
    if i < 2 * folded:
        if i % 2 == 0:
            send(flat[lo:hi], ranks, i + 1).wait()
        else:
            incoming = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
            recv(incoming, ranks, i - 1)
            flat[lo:hi] += incoming


def _fold_out(flat: torch.Tensor, ranks: Ranks, folded: int, part: tuple[int, int] | None = None) -> None:
    """Folded pairs: the odd rank sends the result (or the even rank's part of it) back."""
    i = ranks.index
    lo, hi = part if part is not None else (0, flat.numel())
    if i < 2 * folded:
        if i % 2 == 1:
            send(flat[lo:hi], ranks, i - 1).wait()
        else:
            recv(flat[lo:hi], ranks, i + 1)


def butterfly_all_reduce(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    if ranks.size == 1:
        return flat
    core, folded, power = _core(ranks)
    _fold_in(flat, ranks, folded)
    if _in_core(ranks.index, folded):
        j, distance = core.index, 1
        while distance < power:
            incoming = torch.empty_like(flat)
            exchange(flat, j ^ distance, incoming, j ^ distance, core)
            flat += incoming
            distance <<= 1
    _fold_out(flat, ranks, folded)
    return flat


def _halving_all_reduce(flat: torch.Tensor, ranks: Ranks, distance_doubling: bool) -> torch.Tensor:
    if ranks.size == 1:
        return flat
    core, folded, power = _core(ranks)
    _fold_in(flat, ranks, folded)
    if _in_core(ranks.index, folded):
        levels = _halving_levels(core.index, power, chunk_bounds(flat.numel(), power), distance_doubling)
        _reduce_scatter_levels(flat, core, levels)
        _all_gather_levels(flat, core, levels)
    _fold_out(flat, ranks, folded)
    return flat


def halving_doubling_all_reduce(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    return _halving_all_reduce(flat, ranks, distance_doubling=True)


def rabenseifner_all_reduce(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    return _halving_all_reduce(flat, ranks, distance_doubling=False)


def _core_bounds(numel: int, ranks: Ranks, folded: int, power: int) -> list[tuple[int, int]]:
    """Element range each core rank is responsible for: a folded pair's core rank covers both chunks."""
    chunks = chunk_bounds(numel, ranks.size)
    out = []
    for j in range(ranks.size):
        if j < 2 * folded and j % 2 == 0:
            continue
        out.append((chunks[j - 1][0], chunks[j][1]) if j < 2 * folded else chunks[j])
    assert len(out) == power
    return out


def recursive_reduce_scatter(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Sum in place, leaving rank i's chunk i (chunk_bounds) complete; returns that chunk."""
    i = ranks.index
    chunks = chunk_bounds(flat.numel(), ranks.size)
    if ranks.size == 1:
        return flat
    core, folded, power = _core(ranks)
    _fold_in(flat, ranks, folded)
    if _in_core(i, folded):
        bounds = _core_bounds(flat.numel(), ranks, folded, power)
        _reduce_scatter_levels(flat, core, _halving_levels(core.index, power, bounds, False))
    _fold_out(flat, ranks, folded, part=chunks[i - 1 if i % 2 == 1 else i] if i < 2 * folded else None)
    lo, hi = chunks[i]
    return flat[lo:hi]


def recursive_all_gather(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Rank i contributes chunk i; afterwards every rank holds every chunk (in place)."""
    i = ranks.index
    if ranks.size == 1:
        return flat
    chunks = chunk_bounds(flat.numel(), ranks.size)
    core, folded, power = _core(ranks)
    if i < 2 * folded:  # the even rank's chunk goes to its odd partner, which gathers for both
        if i % 2 == 0:
            send(flat[chunks[i][0]:chunks[i][1]], ranks, i + 1).wait()
        else:
            recv(flat[chunks[i - 1][0]:chunks[i - 1][1]], ranks, i - 1)
    if _in_core(i, folded):
        bounds = _core_bounds(flat.numel(), ranks, folded, power)
        _all_gather_levels(flat, core, _halving_levels(core.index, power, bounds, False))
    _fold_out(flat, ranks, folded)
    return flat
