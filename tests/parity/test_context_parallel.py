"""Context-parallel layouts reproduce single-process training.

Each method at cp 2 and 4 (2d at 2 x 2), composed with ZeRO-3 data parallelism and with tensor
parallelism, and with each recomputation mode somewhere in the matrix. The micro model has
4 query heads and 2 key/value heads (GQA), so Ulysses at cp 4 must copy each kv head to two
ranks, and a 257-token vocabulary (V % tp != 0 in the tensor-parallel case).
"""

import pytest

from parity.harness import CP_PARAM_ATOL, TP_PARAM_ATOL, assert_parity, train_distributed, with_changes


CASES = {
    "ring-cp2": {"cp": 2, "cp_method": "ring"},
    "ring-cp4-selective": {"cp": 4, "cp_method": "ring", "recompute": "selective"},
    "ulysses-cp2-full": {"cp": 2, "cp_method": "ulysses", "recompute": "full"},
    "ulysses-cp4": {"cp": 4, "cp_method": "ulysses"},
    "2d-2x2": {"cp": 4, "cp_method": "2d", "cp_heads": 2},
}


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_matches_single_process(base, reference, tmp_path, name):
    parallel = CASES[name]
    config = with_changes(base, train={"output_dir": str(tmp_path / name)}, parallel=parallel)
    diffs = assert_parity(reference, train_distributed(config, parallel["cp"]), param_atol=CP_PARAM_ATOL)
    print(f"{name}: {diffs}")


def test_dp2_x_cp2_with_zero3(base, reference, tmp_path):
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "dp2cp2")},
                          parallel={"cp": 2, "dp_shard": 2, "zero_stage": 3})
    diffs = assert_parity(reference, train_distributed(config, 4), param_atol=CP_PARAM_ATOL)
    print(f"dp2 x cp2 ring zero3: {diffs}")


def test_tp2_x_cp2_with_sequence_parallel(base, reference, tmp_path):
    config = with_changes(base, train={"output_dir": str(tmp_path / "tp2cp2")},
                          parallel={"cp": 2, "cp_method": "ulysses", "tp": 2, "sequence_parallel": True})
    diffs = assert_parity(reference, train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"tp2 x cp2 ulysses sp: {diffs}")


@pytest.mark.slow
def test_dp2_x_cp2_x_tp2_with_zero2(base, reference, tmp_path):
    """dp x cp x tp on 8 ranks: ring attention, sequence parallelism, ZeRO-2 sharded over dp_shard x cp."""
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "dp2cp2tp2")},
                          parallel={"cp": 2, "tp": 2, "dp_shard": 2, "zero_stage": 2, "sequence_parallel": True})
    diffs = assert_parity(reference, train_distributed(config, 8, timeout=240), param_atol=TP_PARAM_ATOL)
    print(f"dp2 x cp2 x tp2 ring zero2 sp: {diffs}")
