"""Pipeline-parallel layouts reproduce single-process training, for every schedule.

The reference and the pipelined runs train the same 8-block micro model on the same global batch
of 8 sequences per step, as 4 micro-batches of 2 (m = train.grad_accum_steps = 4): the reference
accumulates them in one process, the pipeline sends them through pp stages. pp 4 with the
interleaved schedule runs 8 stages of one block each.

Why the reference accumulates rather than running one micro-batch of 8: on this 8-block model,
accumulating 4 micro-batches in one process already moves a few weights by 3e-5 from the
micro-batch-8 run after 4 steps (fp32 summation order, amplified by Adam on near-zero gradients),
while every pipeline schedule lands within 3e-7 of accumulation. Comparing with accumulation
keeps the tolerance tight (PARAM_ATOL = 1e-5) and isolates what the pipeline changes.
"""

import json

import pytest

from parity.harness import CP_PARAM_ATOL, TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes


@pytest.fixture
def deep(base, tmp_path):
    return with_changes(base, model={"n_layers": 8}, train={"micro_batch_size": 2, "grad_accum_steps": 4,
                                                            "output_dir": str(tmp_path / "single8")})


@pytest.fixture
def deep_reference(deep):
    return train_single(deep)


def _pipelined(config, tmp_path, name, microbatches, pp, schedule="1f1b", virtual=1, **sections):
    return with_changes(config, train={"micro_batch_size": 8 // microbatches, "grad_accum_steps": microbatches,
                                       "output_dir": str(tmp_path / name)},
                        pipeline_parallel={"degree": pp, "schedule": schedule, "virtual": virtual}, **sections)


@pytest.mark.parametrize("pp,schedule,virtual", [
    (2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved", 2), (2, "zb-h1", 1),
    (4, "gpipe", 1), (4, "1f1b", 1), (4, "interleaved", 2), (4, "zb-h1", 1),
])
def test_pipeline_matches_single_process(deep, deep_reference, tmp_path, pp, schedule, virtual):
    config = _pipelined(deep, tmp_path, f"pp{pp}-{schedule}", 4, pp=pp, schedule=schedule, virtual=virtual)
    diffs = assert_parity(deep_reference, train_distributed(config, pp))
    print(f"pp {pp} {schedule} v{virtual}: {diffs}")


@pytest.fixture
def tied(deep, tmp_path):
    return with_changes(deep, model={"tie_embeddings": True}, train={"output_dir": str(tmp_path / "single-tied")})


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tied_embeddings_across_first_and_last_stage(tied, tmp_path, schedule):
    """The last stage's copy of the embedding (the head) and the first stage's get the summed gradient."""
    config = _pipelined(tied, tmp_path, f"tied-{schedule}", 4, pp=2, schedule=schedule)
    diffs = assert_parity(train_single(tied), train_distributed(config, 2))
    print(f"pp 2 {schedule} tied: {diffs}")


@pytest.mark.parametrize("placement", ["outer", "inner"])
def test_pp2_x_dp2_with_zero1_and_tied_embeddings(tied, tmp_path, placement):
    """Either placement of the stages (inner: ranks 0, 1 hold one pipeline, 2, 3 the other) trains the same."""
    config = with_changes(tied, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / "pp-dp")},
                          pipeline_parallel={"degree": 2, "schedule": "1f1b", "placement": placement},
                          data_parallel={"shard": 2, "zero_stage": 1})
    diffs = assert_parity(train_single(tied), train_distributed(config, 4))
    print(f"pp2 x dp2 zero1 tied ({placement}): {diffs}")


def test_pp2_x_dp2_ddp_with_tied_embeddings(tied, tmp_path):
    """DDP's buckets and the tied copies' sum both touch the embedding's gradient: it still equals one process."""
    config = with_changes(tied, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / "pp-ddp-tied")},
                          pipeline_parallel={"degree": 2, "schedule": "1f1b"})
    diffs = assert_parity(train_single(tied), train_distributed(config, 4))
    print(f"pp2 x dp2 ddp tied: {diffs}")


def test_pp2_x_dp2_ddp_interleaved(deep, deep_reference, tmp_path):
    config = with_changes(deep, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / "pp-ddp")},
                          pipeline_parallel={"degree": 2, "schedule": "interleaved", "virtual": 2})
    diffs = assert_parity(deep_reference, train_distributed(config, 4))
    print(f"pp2 x dp2 ddp interleaved: {diffs}")


@pytest.mark.parametrize("overlap", [False, True])
def test_pp2_x_tp2_sequence_parallel_zero_bubble(deep, deep_reference, tmp_path, overlap):
    """With comm_overlap the collective matmuls compute their weight gradients in the I pass (their matmuls are
    not F.linear calls the W pass could defer)."""
    config = _pipelined(deep, tmp_path, "pp-tp", 4, pp=2, schedule="zb-h1",
                        tensor_parallel={"degree": 2, "sequence_parallel": True, "comm_overlap": overlap})
    diffs = assert_parity(deep_reference, train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"pp2 x tp2 sp zb-h1 (overlap {overlap}): {diffs}")


@pytest.mark.parametrize("schedule,virtual", [("interleaved", 2), ("zb-h1", 1)])
def test_pp2_x_tp2_scatter_gather(deep, deep_reference, tmp_path, schedule, virtual):
    """Each tp rank sends half of every activation and gradient; the receivers all-gather them (SC21's
    scatter/gather): the same training as whole messages."""
    config = with_changes(_pipelined(deep, tmp_path, f"pp-tp-sg-{schedule}", 4, pp=2, schedule=schedule,
                                     virtual=virtual, tensor_parallel={"degree": 2}),
                          pipeline_parallel={"scatter_gather": True})
    diffs = assert_parity(deep_reference, train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    # evaluation runs the forward-only path, which scatters and gathers as well
    single, pipelined = (_validation_loss(c.train.output_dir) for c in (deep, config))
    assert abs(single - pipelined) <= 1e-5 * single, (single, pipelined)
    print(f"pp2 x tp2 scatter/gather {schedule}: {diffs}, validation loss {single} vs {pipelined}")


def _validation_loss(output_dir: str) -> float:
    with open(f"{output_dir}/metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "val_loss" in row][-1]["val_loss"]


def test_pp2_x_cp2_ring(deep, deep_reference, tmp_path):
    config = _pipelined(deep, tmp_path, "pp-cp", 4, pp=2, schedule="1f1b", context_parallel={"degree": 2})
    diffs = assert_parity(deep_reference, train_distributed(config, 4), param_atol=CP_PARAM_ATOL)
    print(f"pp2 x cp2 ring: {diffs}")


@pytest.mark.slow
def test_pp2_x_tp2_x_dp2_eight_ranks(deep, deep_reference, tmp_path):
    config = with_changes(deep, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / "pp-tp-dp"),
                                       "recompute": "selective"},
                          pipeline_parallel={"degree": 2, "schedule": "1f1b"}, tensor_parallel={"degree": 2},
                          data_parallel={"shard": 2, "zero_stage": 1})
    diffs = assert_parity(deep_reference, train_distributed(config, 8, timeout=300), param_atol=TP_PARAM_ATOL)
    print(f"pp2 x tp2 x dp2 zero1 selective: {diffs}")


def test_pipeline_resume_is_exact_and_reshards_to_other_depths(tied, tmp_path):
    """pp 2 (zero bubble, tied embeddings): resume is bit-exact; its step-2 checkpoint resumes at pp 4 and in one process.

    Checkpoint keys are per block and per root module (flat_groups.py), so they do not depend on
    the stage split; both copies of the tied embedding write the same key and value.
    """
    from parity.test_resharding import _assert_resume_is_exact

    config = with_changes(_pipelined(tied, tmp_path, "straight", 4, pp=2, schedule="zb-h1"),
                          checkpoint={"every": 2, "keep_last": 2})
    _, straight = _assert_resume_is_exact(config, tmp_path)
    midpoint = tmp_path / "straight" / "step-000002"

    def resume(name, world_size, **pipeline_parallel):
        resumed = with_changes(tied, train={"output_dir": str(tmp_path / name)}, pipeline_parallel=pipeline_parallel,
                               checkpoint={"resume": str(midpoint)})
        losses, weights = train_single(resumed) if world_size == 1 else train_distributed(resumed, world_size)
        return straight[0][:2] + losses, weights

    for result in (resume("pp4", 4, degree=4, schedule="1f1b"), resume("one", 1)):
        diffs = assert_parity(straight, result)
        print(f"pipeline checkpoint resharded: {diffs}")
