"""Context-parallel layouts reproduce single-process training.

Each method at cp 2 and 4 (2d at 2 x 2), composed with ZeRO-3 data parallelism and with tensor
parallelism, and with each recomputation mode somewhere in the matrix. The micro model has
4 query heads and 2 key/value heads (GQA), so Ulysses at cp 4 must copy each kv head to two
ranks, and a 257-token vocabulary (V % tp != 0 in the tensor-parallel case).
"""

import pytest

from parity.harness import CP_PARAM_ATOL, TP_PARAM_ATOL, assert_parity, train_distributed, with_changes


CASES = {
    "ring-cp2": ({"degree": 2, "method": "ring"}, "none"),
    "ring-cp4-selective": ({"degree": 4, "method": "ring"}, "selective"),
    "ulysses-cp2-full": ({"degree": 2, "method": "ulysses"}, "full"),
    "ulysses-cp4": ({"degree": 4, "method": "ulysses"}, "none"),
    "2d-2x2": ({"degree": 4, "method": "2d", "heads": 2}, "none"),
    # double-ring attention: 2 rounds of an inner ring of 2; and 2d placed context-first with a ring of
    # 2 rounds of 1 (every K/V hop on the outer ring), in backward with recomputation
    "double-ring-2x2": ({"degree": 4, "method": "ring", "inner_ring": 2}, "none"),
    "2d-2x2-context-first-outer": ({"degree": 4, "method": "2d", "heads": 2, "placement": "context-first",
                                    "inner_ring": 1}, "selective"),
}


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_matches_single_process(base, reference, tmp_path, name):
    context, recompute = CASES[name]
    config = with_changes(base, train={"output_dir": str(tmp_path / name), "recompute": recompute},
                          context_parallel=context)
    diffs = assert_parity(reference, train_distributed(config, context["degree"]), param_atol=CP_PARAM_ATOL)
    print(f"{name}: {diffs}")


def test_dp2_x_cp2_with_zero3(base, reference, tmp_path):
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "dp2cp2")},
                          context_parallel={"degree": 2}, data_parallel={"shard": 2, "zero_stage": 3})
    diffs = assert_parity(reference, train_distributed(config, 4), param_atol=CP_PARAM_ATOL)
    print(f"dp2 x cp2 ring zero3: {diffs}")


def test_tp2_x_cp2_with_sequence_parallel(base, reference, tmp_path):
    config = with_changes(base, train={"output_dir": str(tmp_path / "tp2cp2")},
                          context_parallel={"degree": 2, "method": "ulysses"}, tensor_parallel={"degree": 2, "sequence_parallel": True})
    diffs = assert_parity(reference, train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"tp2 x cp2 ulysses sp: {diffs}")


@pytest.mark.slow
def test_dp2_x_cp2_x_tp2_with_zero2(base, reference, tmp_path):
    """dp x cp x tp on 8 ranks: ring attention, sequence parallelism, ZeRO-2 sharded over dp_shard x cp."""
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "dp2cp2tp2")},
                          context_parallel={"degree": 2}, tensor_parallel={"degree": 2, "sequence_parallel": True}, data_parallel={"shard": 2, "zero_stage": 2})
    diffs = assert_parity(reference, train_distributed(config, 8, timeout=240), param_atol=TP_PARAM_ATOL)
    print(f"dp2 x cp2 x tp2 ring zero2 sp: {diffs}")
