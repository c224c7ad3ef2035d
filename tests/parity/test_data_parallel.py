"""Data-parallel layouts reproduce single-process training (same global batch, same seed)."""

import pytest

from parity.harness import assert_parity, train_distributed, train_single, with_changes


@pytest.fixture
def base(job, tmp_path):
    # The single-process reference: global batch 8 = micro 8 x accum 1.
    return with_changes(job, train={"micro_batch_size": 8, "steps": 4, "eval_every": 4, "output_dir": str(tmp_path / "single")},
                        checkpoint={"every": 0})


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_single_process(base, tmp_path, world_size):
    reference = train_single(base)
    ddp = with_changes(base, train={"micro_batch_size": 8 // world_size, "output_dir": str(tmp_path / f"ddp{world_size}")})
    diffs = assert_parity(reference, train_distributed(ddp, world_size))
    print(f"DDP x{world_size}: {diffs}")


def test_ddp_with_accumulation_and_small_buckets(base, tmp_path):
    """2 ranks x micro 2 x accum 2; 0.01 MiB buckets force many buckets launched in order."""
    reference = train_single(base)
    ddp = with_changes(base, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / "acc")},
                       parallel={"bucket_mb": 0.01})
    assert_parity(reference, train_distributed(ddp, 2))


def test_bf16_gradient_reduction_is_close_but_not_exact(base, tmp_path):
    reference = train_single(base)
    ddp = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "bf16")}, parallel={"reduce_dtype": "bf16"})
    result = train_distributed(ddp, 2)
    assert_parity(reference, result, loss_rtol=1e-2, param_atol=1e-2)
    with pytest.raises(AssertionError):
        assert_parity(reference, result)
