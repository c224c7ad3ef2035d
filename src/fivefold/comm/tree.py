"""Tree collectives: pipelined binary and double binary tree all-reduce, binomial and chain broadcast/reduce.

    tree            a binary tree (heap order: the parent of position q is (q-1)//2, root 0); the
                    vector is cut into chunks, each reduced up to the root and broadcast back down;
                    later chunks climb while earlier ones descend (pipelining).
    double_tree     NCCL's double binary tree (Sanders, Speck & Träff 2009): half the vector on a
                    tree, half on its mirror image (rank p-1-q at position q), so the ranks that are
                    leaves of one tree (the upper half) are the inner nodes of the other, and every
                    rank sends and receives about the same load.
    binomial        broadcast / reduce along a binomial tree rooted anywhere: ceil(log2 p) rounds.
    chain           broadcast / reduce along a pipelined chain (root, root+1, ...), chunk by chunk.

Cost (n bytes, k chunks, alpha, beta, gamma; depth d = floor(log2 p)):
    tree (unpipelined, k = 1)   2 d (alpha + n beta) + d n gamma
    tree, pipelined             2 (d + k - 1) (alpha + n/k beta) + (d + k - 1) n/k gamma (about 2 n beta for large k)
    double_tree                 each tree carries n/2: 2 (d + k - 1) (alpha + n/(2k) beta) + ...
    binomial broadcast/reduce   ceil(log2 p) (alpha + n beta)
    chain broadcast/reduce      (p - 2 + k) (alpha + n/k beta)
Messages between two ranks are always posted in the same order on both sides (chunk by chunk,
the phases in a fixed order), which keeps the interleaved trees free of mismatches.
"""

from __future__ import annotations

import torch

from fivefold.comm.p2p import Handle, Ranks, chunk_bounds, recv, send

DEFAULT_CHUNK_ELEMENTS = 1 << 16


def _chunks(lo: int, hi: int, chunk_elements: int) -> list[tuple[int, int]]:
    count = max(1, -(-(hi - lo) // chunk_elements))
    return [(lo + a, lo + b) for a, b in chunk_bounds(hi - lo, count)]


class _BinaryTree:
    """Parent and children of each rank in a heap-ordered binary tree (optionally mirrored: rank p-1-q at position q)."""

    def __init__(self, p: int, mirrored: bool = False):
        self.p, self.mirrored = p, mirrored

    def position(self, index: int) -> int:
        return self.p - 1 - index if self.mirrored else index

    index = position  # the mapping is its own inverse

    def parent(self, index: int) -> int | None:
        q = self.position(index)
        return None if q == 0 else self.index((q - 1) // 2)

    def children(self, index: int) -> list[int]:
        q = self.position(index)
        return [self.index(c) for c in (2 * q + 1, 2 * q + 2) if c < self.p]


def _up(flat: torch.Tensor, ranks: Ranks, tree: _BinaryTree, chunk: tuple[int, int], pending: list) -> None:
    """Add the children's partial sums of one chunk and pass the sum to the parent."""
    i = ranks.index
    lo, hi = chunk
    for child in tree.children(i):
        incoming = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
        recv(incoming, ranks, child)
        flat[lo:hi] += incoming
    parent = tree.parent(i)
    if parent is not None:
        pending.append(send(flat[lo:hi], ranks, parent))


def _down(flat: torch.Tensor, ranks: Ranks, tree: _BinaryTree, chunk: tuple[int, int], pending: list) -> None:
    """Take the reduced chunk from the parent (the root has it) and pass it to the children."""
    i = ranks.index
    lo, hi = chunk
    parent = tree.parent(i)
    if parent is not None:
        # The parent can only send the sum after receiving our partial sum, so our send of this
        # chunk has completed before the result overwrites it.
        recv(flat[lo:hi], ranks, parent)
    for child in tree.children(i):
        pending.append(send(flat[lo:hi], ranks, child))


def _run_trees(flat: torch.Tensor, ranks: Ranks, parts: list[tuple[_BinaryTree, tuple[int, int]]],
               chunk_elements: int) -> torch.Tensor:
    """Chunk c climbs every tree at iteration c and descends at iteration c + depth + 1 (pipelining).

    Every rank walks the same (iteration, phase) sequence, so the messages between any two ranks
    are sent and received in the same order (what NCCL needs) and the waits form no cycle.
    """
    pending: list[Handle] = []
    schedules = [(tree, _chunks(lo, hi, chunk_elements)) for tree, (lo, hi) in parts if hi > lo]
    lag = (ranks.size).bit_length()  # tree depth + 1
    total = max((len(chunks) for _, chunks in schedules), default=0)
    for iteration in range(total + lag):
        for tree, chunks in schedules:
            if iteration < len(chunks):
                _up(flat, ranks, tree, chunks[iteration], pending)
        for tree, chunks in schedules:
            if 0 <= iteration - lag < len(chunks):
                _down(flat, ranks, tree, chunks[iteration - lag], pending)
    for work in pending:
        work.wait()
    return flat


def tree_all_reduce(flat: torch.Tensor, ranks: Ranks, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    if ranks.size == 1:
        return flat
    return _run_trees(flat, ranks, [(_BinaryTree(ranks.size), (0, flat.numel()))], chunk_elements)


def double_tree_all_reduce(flat: torch.Tensor, ranks: Ranks, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    if ranks.size == 1:
        return flat
    half = flat.numel() // 2
    trees = [(_BinaryTree(ranks.size), (0, half)), (_BinaryTree(ranks.size, mirrored=True), (half, flat.numel()))]
    return _run_trees(flat, ranks, trees, chunk_elements)


# ------------------------------------------------------------------------------ broadcast, reduce
def binomial_broadcast(flat: torch.Tensor, ranks: Ranks, root: int = 0) -> torch.Tensor:
    p = ranks.size
    v = (ranks.index - root) % p  # position relative to the root
    mask, pending = 1, []
    while mask < p:
        if v < mask and v + mask < p:
            pending.append(send(flat, ranks, root + v + mask))
        elif mask <= v < 2 * mask:
            recv(flat, ranks, root + v - mask)
        mask <<= 1
    for work in pending:
        work.wait()
    return flat


def binomial_reduce(flat: torch.Tensor, ranks: Ranks, root: int = 0) -> torch.Tensor:
    """Sum onto the root (other ranks' tensors are left holding partial sums)."""
    p = ranks.size
    v = (ranks.index - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            send(flat, ranks, root + v - mask).wait()
            break
        if v + mask < p:
            incoming = torch.empty_like(flat)
            recv(incoming, ranks, root + v + mask)
            flat += incoming
        mask <<= 1
    return flat


def chain_broadcast(flat: torch.Tensor, ranks: Ranks, root: int = 0,
                    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    p = ranks.size
    v = (ranks.index - root) % p
    pending = []
    for lo, hi in _chunks(0, flat.numel(), chunk_elements):
        if v > 0:
            recv(flat[lo:hi], ranks, root + v - 1)
        if v < p - 1:
            pending.append(send(flat[lo:hi], ranks, root + v + 1))
    for work in pending:
        work.wait()
    return flat


def chain_reduce(flat: torch.Tensor, ranks: Ranks, root: int = 0,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """Sum onto the root along the chain root <- root+1 <- ... <- root+p-1, chunk by chunk."""
    p = ranks.size
    v = (ranks.index - root) % p
    pending = []
    for lo, hi in _chunks(0, flat.numel(), chunk_elements):
        if v < p - 1:
            incoming = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
            recv(incoming, ranks, root + v + 1)
            flat[lo:hi] += incoming
        if v > 0:
            pending.append(send(flat[lo:hi].clone(), ranks, root + v - 1))
    for work in pending:
        work.wait()
    return flat
