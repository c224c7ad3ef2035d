"""Priority communication scheduling (gradient_comm.schedule = priority) keeps DDP's exact update.

Slices are reduced in a negotiated order and each module is updated just before its next forward,
but every parameter still gets the sum of all ranks' gradients and one AdamW step per step: the
run must match single-process training (both without clipping, which the schedule excludes). When
every slice is ready at once (gradients accumulated under no_sync, then handed over together) the
order must be exactly the next forward's: by priority. The slices are the ones the planner prices and the
simulator plays (sim/workload.py), and each unit's next forward waits there for the slices its parameters lie in.
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


def _order(rank: int, world_size: int) -> tuple[list[int], list[int], list[tuple[int, int, int]], dict[str, list[int]]]:
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
    slices = [(s.bucket, 4 * (s.hi - s.lo), s.priority) for s in ddp.slices]
    units: dict[str, list[int]] = {}  # what each unit's modules wait for before their next forward
    for name, param in model.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else \
            {"tok_embeddings": "embedding"}.get(name.split(".")[0], "head")
        units[unit] = sorted(set(units.get(unit, [])) | set(ddp._slices_of[id(param)]))
    return ddp.order_log[-1], expected, slices, units


def test_slices_ready_together_go_in_forward_order():
    from fivefold.config import load_config
    from fivefold.plan.cluster import PRESETS
    from fivefold.sim.workload import build_workload

    config = load_config(None, ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads",
                                "2", "--model.multiple_of", "16", "--model.max_seq_len", "16", "--train.seq_len", "16",
                                "--train.max_grad_norm", "0", "--gradient_comm.schedule", "priority",
                                "--gradient_comm.bucket_mb", "0.02", "--gradient_comm.slice_mb", "0.005"])
    simulated = build_workload(config, 2, PRESETS["h100-sxm"], vocab_size=64)
    for order, expected, slices, units in run_distributed(_order, 2):
        assert order == expected and len(order) > 4
        assert [(piece.bucket, piece.nbytes, piece.priority) for piece in simulated.slices] == slices
        assert {unit: sorted(ks) for unit, ks in simulated.unit_slices.items()} == units
