"""Context-parallel attention (ring, Ulysses, 2D) equals whole-sequence causal attention, values and gradients.

Both block kernels of ring attention are checked: the fused CPU flash kernel and the portable
einsum one. Each rank holds its zigzag shard of q, k, v (4 query heads, 2 key/value heads: GQA) and of the
output gradient; the outputs and the q, k, v gradients it computes must equal the matching
rows of single-process attention over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.parallel.context_parallel import (
    ContextParallelAttention,
    ContextParallelLayout,
    build_context_parallel_groups,
)

from distributed.spawn import run_distributed

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(BATCH, h, SEQ, HEAD_DIM, generator=g, dtype=torch.float64)
                     for h in (Q_HEADS, KV_HEADS, KV_HEADS, Q_HEADS))
    return q, k, v, dout


def _reference():
    q, k, v, dout = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rank(rank: int, world: int, ring: int, heads: int, dtype, fused: bool = True, inner: int = 0,
          head_first: bool = True) -> float:
    if not fused:  # the portable einsum block kernel instead of the CPU flash kernel
        from fivefold.parallel import context_parallel

        context_parallel._FUSED_FORWARD = None
    layout = ContextParallelLayout(ring=ring, heads=heads, inner=inner, head_first=head_first)
    from fivefold.parallel.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(cp=world, world_size=world), "cpu")
    groups = build_context_parallel_groups(mesh, layout)
    positions = layout.shard_positions(SEQ, groups.cp_rank)
    q, k, v, dout = (t[:, :, positions].to(dtype).requires_grad_() for t in _inputs())
    out = ContextParallelAttention(groups)(q, k, v)
    out.backward(dout.detach())
    expected = [t[:, :, positions] for t in _reference()]
    return max(float((got.detach().double() - want).abs().max())
               for got, want in zip((out, q.grad, k.grad, v.grad), expected))


@pytest.mark.parametrize("ring,heads", [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)],
                         ids=["ring2", "ring4", "ulysses2", "ulysses4", "2d-2x2"])
def test_context_parallel_attention_matches_whole_sequence(ring, heads):
    errors = run_distributed(_rank, ring * heads, ring, heads, torch.float64, timeout=60)
    assert max(errors) < 1e-12, errors


@pytest.mark.parametrize("ring,heads,inner,head_first,fused", [(4, 1, 2, True, True), (4, 1, 1, True, False),
                                                              (2, 2, 1, False, True)],
                         ids=["double-ring-2x2", "ring4-as-4-rounds-portable", "2d-2x2-context-first-2-rounds"])
def test_double_ring_and_placements_match_whole_sequence(ring, heads, inner, head_first, fused):
    errors = run_distributed(_rank, ring * heads, ring, heads, torch.float64, fused, inner, head_first, timeout=60)
    assert max(errors) < 1e-12, errors


@pytest.mark.parametrize("ring,heads", [(4, 1), (2, 2)], ids=["ring4", "2d-2x2"])
def test_portable_block_kernel_matches_whole_sequence(ring, heads):
    errors = run_distributed(_rank, ring * heads, ring, heads, torch.float64, False, timeout=60)
    assert max(errors) < 1e-12, errors


def test_shards_cover_the_sequence_once_and_balance_causal_work():
    for layout in (ContextParallelLayout(4, 1), ContextParallelLayout(1, 4), ContextParallelLayout(2, 2)):
        shards = [layout.shard_positions(SEQ, r) for r in range(layout.cp)]
        assert sorted(torch.cat(shards).tolist()) == list(range(SEQ))
        if layout.heads == 1:  # zigzag: every ring rank's queries see the same number of keys
            work = {int((s + 1).sum()) for s in shards}
            assert len(work) == 1, work


def test_each_method_has_its_own_grid_and_sharding():
    """context_parallel.method and context_parallel.heads pick the (ring, heads) grid parallelize() builds."""
    assert ContextParallelLayout.for_method("ring", 4, 2) == ContextParallelLayout(ring=4, heads=1)
    assert ContextParallelLayout.for_method("ulysses", 4, 2) == ContextParallelLayout(ring=1, heads=4)
    assert ContextParallelLayout.for_method("2d", 4, 2) == ContextParallelLayout(ring=2, heads=2)
    assert ContextParallelLayout.for_method("2d", 8, 4) == ContextParallelLayout(ring=2, heads=4)
    assert ContextParallelLayout(1, 4).shard_positions(SEQ, 1).tolist() == list(range(4, 8))  # Ulysses: contiguous
    assert ContextParallelLayout(4, 1).shard_positions(SEQ, 1).tolist() == [2, 3, 12, 13]  # ring: zigzag
    # 2d: ring rank 0 holds chunks 0 and 3 of 4 (zigzag), split over its 2 head ranks
    assert ContextParallelLayout(2, 2).shard_positions(SEQ, 1).tolist() == [12, 13, 14, 15]
    assert ContextParallelLayout(2, 2).shard_positions(SEQ, 2).tolist() == [4, 5, 6, 7]
