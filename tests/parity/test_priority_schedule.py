"""Priority communication scheduling (gradient_comm.schedule = priority) keeps DDP's exact update.

Slices are reduced in a negotiated order and each module is updated just before its next forward,
but every parameter still gets the sum of all ranks' gradients and one AdamW step per step: the
run must match single-process training (both without clipping, which the schedule excludes). When
every slice is ready at once (gradients accumulated under no_sync, then handed over together) the
order must be exactly the next forward's: by priority. The slices are the ones the planner prices.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed.spawn import run_distributed
from parity.harness import assert_parity, train_distributed, train_single, with_changes


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_priority_schedule_matches_single_process(base, tmp_path, algorithm):
    unclipped = with_changes(base, train={"max_grad_norm": 0.0})
    reference = train_single(unclipped)
    run = with_changes(unclipped, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / algorithm)},
                       gradient_comm={"schedule": "priority", "allreduce_algorithm": algorithm, "bucket_mb": 0.05, "slice_mb": 0.01})
    diffs = assert_parity(reference, train_distributed(run, 2))
    print(f"priority {algorithm}: {diffs}")


def _order(rank: int, world_size: int) -> tuple[list[int], list[int]]:
    from fivefold.comm.reducers import NativeReducer
    from fivefold.model import ModelConfig, build_model, materialize
    from fivefold.parallel.comm_schedule import PriorityDataParallel
    from fivefold.parallel.mesh import private_copy

    from fivefold.plan.parameters import priority_slice_bytes

    shape = ModelConfig(name="m", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=16,
                        vocab_size=64)
    model = materialize(build_model(shape), torch.device("cpu"), seed=0)
    group = private_copy(dist.group.WORLD)
    ddp = PriorityDataParallel(model, group, bucket_cap_mb=0.02, reducer=NativeReducer(group), slice_mb=0.005)
    # the planner prices exactly these slices (plan/estimate.py `_priority_time`)
    assert priority_slice_bytes(shape, 1, 0.02, 0.005, 4) == tuple(4 * (s.hi - s.lo) for s in ddp.slices)
    with ddp.no_sync():
        model(torch.randint(0, 64, (2, 16))).sum().backward()
    expected = sorted(range(len(ddp.slices)), key=lambda k: (ddp.slices[k].priority, k))
    ddp.finish_gradient_sync()
    ddp.defer_update(lambda params: None)
    ddp.flush()
    return ddp.order_log[-1], expected


def test_slices_ready_together_go_in_forward_order():
    for order, expected in run_distributed(_order, 2):
        assert order == expected and len(order) > 4
