"""Tensor (and sequence) parallel layouts reproduce single-process training.

The micro model has 4 query heads, 2 key/value heads and a 257-token vocabulary, so tp = 2
splits the kv heads, tp = 4 replicates each kv head on 2 ranks, and V % tp != 0 pads the
vocabulary (the padding must not change the loss).
"""

import pytest

from parity.harness import TP_PARAM_ATOL, assert_parity, train_distributed, with_changes


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_tensor_parallel_matches_single_process(base, reference, tmp_path, tp, sp):
    config = with_changes(base, train={"output_dir": str(tmp_path / f"tp{tp}{sp}")},
                          tensor_parallel={"degree": tp, "sequence_parallel": sp})
    diffs = assert_parity(reference, train_distributed(config, tp), param_atol=TP_PARAM_ATOL)
    print(f"tp {tp} sp {sp}: {diffs}")


def test_dp2_x_tp2_with_zero3_and_full_recompute(base, reference, tmp_path):
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "dp2tp2"), "recompute": "full"},
                          tensor_parallel={"degree": 2, "sequence_parallel": True}, data_parallel={"shard": 2, "zero_stage": 3})
    diffs = assert_parity(reference, train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"dp2 x tp2 zero3 sp full recompute: {diffs}")


def test_dp2_x_tp2_ddp(base, reference, tmp_path):
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "ddp-tp"), "recompute": "selective"},
                          tensor_parallel={"degree": 2})
    diffs = assert_parity(reference, train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"dp2 x tp2 ddp selective recompute: {diffs}")


@pytest.mark.parametrize("tp", [2, 4])
def test_comm_overlap_matches_single_process(base, reference, tmp_path, tp):
    """Collective matmuls (tensor_parallel.comm_overlap): tp 4 replicates the kv heads, so their summed gradients
    go through the shared all-gather -> matmul ring too."""
    config = with_changes(base, train={"output_dir": str(tmp_path / f"overlap{tp}")},
                          tensor_parallel={"degree": tp, "sequence_parallel": True, "comm_overlap": True})
    diffs = assert_parity(reference, train_distributed(config, tp), param_atol=TP_PARAM_ATOL)
    print(f"tp {tp} sp + comm overlap: {diffs}")


def test_comm_overlap_with_dp_zero3_recompute_and_qwen_biases(base, reference, tmp_path):
    """dp 2 x tp 2 with ZeRO-3 and full recomputation (the ring runs again in backward), on a model with
    q/k/v biases and per-head q/k norms."""
    model = {"attention_bias": "qkv", "qk_norm": "head"}
    single = with_changes(base, model=model, train={"output_dir": str(tmp_path / "single-qwen")})
    config = with_changes(base, model=model,
                          train={"micro_batch_size": 4, "output_dir": str(tmp_path / "overlap-dp"), "recompute": "full"},
                          tensor_parallel={"degree": 2, "sequence_parallel": True, "comm_overlap": True},
                          data_parallel={"shard": 2, "zero_stage": 3})
    from parity.harness import train_single
    diffs = assert_parity(train_single(single), train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"dp2 x tp2 sp overlap zero3 full recompute, qkv bias + head qk norm: {diffs}")
