"""The hand-written collectives equal torch.distributed's own, for world sizes 2 to 8.

Integer tensors must match exactly (any summation order gives the same integers); float tensors
within rounding. Sizes include ones that do not divide by p and ones smaller than p (empty chunks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed.spawn import run_distributed

SIZES = (5, 1031)  # 5 < p from p = 6: empty chunks


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _check_all(rank: int, world_size: int) -> list[str]:
    from fivefold.comm import ALL_REDUCE, all_reduce
    from fivefold.comm.alltoall import pairwise_all_to_all
    from fivefold.comm.p2p import Ranks, chunk_bounds
    from fivefold.comm.recursive import recursive_all_gather, recursive_reduce_scatter
    from fivefold.comm.ring import ring_all_gather, ring_reduce_scatter
    from fivefold.comm.tree import binomial_broadcast, binomial_reduce, chain_broadcast, chain_reduce

    checked = []
    ranks = Ranks.world()
    for dtype in (torch.int64, torch.float32):
        exact = not dtype.is_floating_point
        for numel in SIZES:
            mine = _data(rank, numel, dtype)
            expected = mine.clone()
            dist.all_reduce(expected)

            def same(actual, wanted, what):
                if exact:
                    assert torch.equal(actual, wanted), what
                else:
                    torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5, msg=what)
                checked.append(what)

            node_sizes = [d for d in (1, 2, 3, 4) if world_size % d == 0 and d < world_size]
            for name in ALL_REDUCE:
                for node_size in (node_sizes if name == "hierarchical" else [0]):
                    out = mine.clone()
                    all_reduce(out, name, node_size=node_size)
                    same(out, expected, f"all_reduce {name} node {node_size} {dtype} n={numel}")
            for tree_chunk in (2, 64):  # pipelined trees with several chunks
                from fivefold.comm.tree import double_tree_all_reduce, tree_all_reduce

                for fn in (tree_all_reduce, double_tree_all_reduce):
                    out = mine.clone()
                    fn(out, ranks, chunk_elements=tree_chunk)
                    same(out, expected, f"{fn.__name__} chunk {tree_chunk} {dtype} n={numel}")
            lo, hi = chunk_bounds(numel, world_size)[rank]
            for fn in (ring_reduce_scatter, recursive_reduce_scatter):
                out = mine.clone()
                same(fn(out, ranks), expected[lo:hi], f"{fn.__name__} {dtype} n={numel}")
            gathered = torch.zeros_like(mine)
            gathered[lo:hi] = mine[lo:hi]
            owned = [torch.zeros_like(mine) for _ in range(world_size)]
            dist.all_gather(owned, gathered)
            everyone = torch.stack(owned).sum(0)
            for fn in (ring_all_gather, recursive_all_gather):
                out = gathered.clone()
                same(fn(out, ranks), everyone, f"{fn.__name__} {dtype} n={numel}")
            for root in {0, world_size - 1}:
                wanted = mine.clone()
                dist.broadcast(wanted, src=root)
                for fn in (binomial_broadcast, chain_broadcast):
                    out = mine.clone()
                    same(fn(out, ranks, root), wanted, f"{fn.__name__} root {root} {dtype} n={numel}")
                for fn in (binomial_reduce, chain_reduce):
                    out = mine.clone()
                    fn(out, ranks, root)
                    if rank == root:
                        same(out, expected, f"{fn.__name__} root {root} {dtype} n={numel}")
        per = 3
        inp = _data(rank, per * world_size, dtype)
        wanted = torch.empty_like(inp)
        dist.all_to_all_single(wanted, inp)
        same(pairwise_all_to_all(torch.empty_like(inp), inp, ranks), wanted, f"all_to_all {dtype}")
    return checked


@pytest.mark.parametrize("world_size", range(2, 9))
def test_collectives_equal_the_backend(world_size):
    checked = run_distributed(_check_all, world_size, timeout=240)
    assert len(checked[0]) > 50


def test_torus_shape_is_near_square():
    from fivefold.comm.two_level import torus_shape

    assert [torus_shape(p) for p in (2, 4, 6, 8, 9, 12, 7)] == [(2, 1), (2, 2), (3, 2), (4, 2), (3, 3), (4, 3), (7, 1)]
