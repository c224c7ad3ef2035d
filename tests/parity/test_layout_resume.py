"""Resume across tensor- and pipeline-parallel degrees: the continued losses equal the uninterrupted run.

A run saves at step 2 of 4 and goes on to step 4 (the uninterrupted run); a second run resumes
the step-2 checkpoint under another tp or pp degree and trains steps 3 and 4. A tp change goes
through whole tensors (weights and both AdamW moments consolidated, this rank's piece cut out:
parallel/checkpoint_layout.py); a pp change reads the same global group names. Tolerances are
the parity harness's: TP_PARAM_ATOL where tensor parallelism changes summation order.
"""

import pytest

from parity.harness import PARAM_ATOL, TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes


def _train(config, world_size):
    return train_single(config) if world_size == 1 else train_distributed(config, world_size)


def _world(sections: dict) -> int:
    degree = {name: sections.get(name, {}).get("degree", 1) for name in ("tensor_parallel", "pipeline_parallel")}
    return degree["tensor_parallel"] * degree["pipeline_parallel"] * sections.get("data_parallel", {}).get("shard", 1)


def _save_then_resume(base, tmp_path, saved: dict, resumed: dict, train: dict | None = None,
                      resumed_train: dict | None = None):
    """(uninterrupted losses and weights, resumed run's losses prefixed with the saved run's first two)."""
    train = train or {}
    resumed_train = resumed_train or train
    first = with_changes(base, train={**train, "output_dir": str(tmp_path / "saved")}, **saved,
                         checkpoint={"every": 2, "keep_last": 2})
    straight = _train(first, _world(saved))
    again = with_changes(base, train={**resumed_train, "output_dir": str(tmp_path / "resumed")}, **resumed,
                         checkpoint={"resume": str(tmp_path / "saved" / "step-000002")})
    losses, weights = _train(again, _world(resumed))
    return straight, (straight[0][:2] + losses, weights)


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_resume_at_another_tensor_parallel_degree(base, tmp_path, saved, resumed):
    straight, result = _save_then_resume(base, tmp_path, {"tensor_parallel": {"degree": saved}},
                                         {"tensor_parallel": {"degree": resumed}})
    diffs = assert_parity(straight, result, param_atol=TP_PARAM_ATOL)
    print(f"tp {saved} -> {resumed}: {diffs}")


def test_resume_at_another_tensor_parallel_degree_under_zero(base, tmp_path):
    """tp 2 saved without ZeRO resumes at tp 1 with ZeRO-2 over 2 ranks: the pieces are cut, then sharded."""
    straight, result = _save_then_resume(base, tmp_path, {"tensor_parallel": {"degree": 2}},
                                         {"data_parallel": {"shard": 2, "zero_stage": 2}},
                                         resumed_train={"micro_batch_size": 4})
    diffs = assert_parity(straight, result, param_atol=TP_PARAM_ATOL)
    print(f"tp 2 -> ZeRO-2 x 2: {diffs}")


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)], ids=["pp2-to-pp1", "pp1-to-pp2"])
def test_resume_at_another_pipeline_degree(base, tmp_path, saved, resumed):
    """4 micro-batches of 2 per step, so every pipeline degree accumulates the same batches."""
    straight, result = _save_then_resume(base, tmp_path, {"pipeline_parallel": {"degree": saved}},
                                         {"pipeline_parallel": {"degree": resumed}},
                                         train={"micro_batch_size": 2, "grad_accum_steps": 4})
    diffs = assert_parity(straight, result, param_atol=PARAM_ATOL)
    print(f"pp {saved} -> {resumed}: {diffs}")


def test_resume_with_the_pipeline_placed_inside_data_parallelism(base, tmp_path):
    """pp 2 x dp 2 with ZeRO-1 saved with the pipeline outermost resumes with it inside data parallelism
    (pipeline_parallel.placement = inner): each rank now holds another stage or shard, read by name."""
    layout = {"pipeline_parallel": {"degree": 2}, "data_parallel": {"shard": 2, "zero_stage": 1}}
    inner = {**layout, "pipeline_parallel": {"degree": 2, "placement": "inner"}}
    straight, result = _save_then_resume(base, tmp_path, layout, inner, train={"micro_batch_size": 2, "grad_accum_steps": 2})
    diffs = assert_parity(straight, result, param_atol=PARAM_ATOL)
    print(f"pp 2 x dp 2 outer -> inner: {diffs}")
