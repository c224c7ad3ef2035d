"""The operators ring attention adds to a block (plan/operators.py `ring_attention_operators`, counted on a loopback
ring in one process) are those ring rank 0 of a real ring dispatches.

Each rank builds the planner's small copy of a block, replaces its attention core with the runtime's ring over a
real process group, and counts every aten operator but views in one forward and backward; rank 0 reports its
count less each exchange's own (the receive buffer, the send, the receive), which the planner prices apart as
posting. That must equal the loopback count exactly, for a ring of 2, of 4, and a double ring of 2 x 2.
"""

from __future__ import annotations

import dataclasses

import pytest

from distributed.spawn import run_distributed


def _model():
    from fivefold.model.presets import get_preset
    from fivefold.plan.operators import small_copy

    return dataclasses.replace(small_copy(get_preset("tiny")), n_experts=0)


def _counted(rank: int, world_size: int, inner: int) -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.model.llama import TransformerBlock, rope_tables
    from fivefold.parallel.context_parallel import ContextParallelAttention, ContextParallelGroups, ContextParallelLayout
    from fivefold.plan.operators import count_block_operators

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = self.sends = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += not func.is_view
            self.sends += "c10d.send" in str(func)
            return func(*args, **(kwargs or {}))

    model = _model()
    layout = ContextParallelLayout(ring=world_size, heads=1, inner=inner)
    groups = ContextParallelGroups(layout, rank, None, dist.group.WORLD, list(range(world_size)))
    block = TransformerBlock(model, 0)
    block.attention.core = ContextParallelAttention(groups)
    cos, sin = rope_tables(model, torch.device("cpu"))
    x = torch.randn(1, 16, model.dim, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    with Counter() as counter:
        block(x, cos[:16], sin[:16]).sum().backward()
    return counter.calls, counter.sends, count_block_operators(model, 0)


@pytest.mark.parametrize("world_size,inner", [(2, 0), (4, 0), (4, 2)])
def test_loopback_count_is_the_real_rings(world_size, inner):
    from fivefold.plan.operators import ring_attention_operators

    calls, sends, plain = run_distributed(_counted, world_size, inner)[0]
    assert sends > 0
    extra = (calls - 3 * sends - plain) / plain
    assert extra == pytest.approx(ring_attention_operators(_model(), world_size, inner), abs=1e-12) and extra > 0.2
