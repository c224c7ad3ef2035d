"""Data-parallel layouts reproduce single-process training (same global batch, same seed)."""

import pytest

from parity.harness import assert_parity, train_distributed, train_single, with_changes


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
                       gradient_comm={"bucket_mb": 0.01})
    assert_parity(reference, train_distributed(ddp, 2))


def test_bf16_gradient_reduction_is_close_but_not_exact(base, tmp_path):
    reference = train_single(base)
    ddp = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "bf16")}, gradient_comm={"reduce_dtype": "bf16"})
    result = train_distributed(ddp, 2)
    assert_parity(reference, result, loss_rtol=1e-2, param_atol=1e-2)
    with pytest.raises(AssertionError):
        assert_parity(reference, result)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_matches_single_process(base, tmp_path, stage, world_size):
    reference = train_single(base)
    zero = with_changes(base, train={"micro_batch_size": 8 // world_size, "output_dir": str(tmp_path / f"z{stage}-{world_size}")},
                        data_parallel={"shard": world_size, "zero_stage": stage})
    diffs = assert_parity(reference, train_distributed(zero, world_size))
    print(f"ZeRO-{stage} x{world_size}: {diffs}")


def test_hybrid_dp_replicate_2_x_dp_shard_2_zero3_with_accumulation(base, tmp_path):
    reference = train_single(base)
    hybrid = with_changes(base, train={"micro_batch_size": 1, "grad_accum_steps": 2, "output_dir": str(tmp_path / "hsdp")},
                          data_parallel={"replicate": 2, "shard": 2, "zero_stage": 3})
    assert_parity(reference, train_distributed(hybrid, 4))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_accumulation(base, tmp_path, stage):
    reference = train_single(base)
    zero = with_changes(base, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / f"acc{stage}")},
                        data_parallel={"shard": 2, "zero_stage": stage})
    assert_parity(reference, train_distributed(zero, 2))


def test_zero3_cpu_offload(base, tmp_path):
    reference = train_single(base)
    zero = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "offload")},
                        data_parallel={"shard": 2, "zero_stage": 3, "offload": True})
    assert_parity(reference, train_distributed(zero, 2))


def test_bf16_mixed_precision_zero2(base, tmp_path):
    """bf16 compute weights, fp32 masters: close to fp32 training (looser tolerance), not identical."""
    reference = train_single(base)
    zero = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "bf16")},
                        data_parallel={"shard": 2, "zero_stage": 2, "param_dtype": "bf16"})
    result = train_distributed(zero, 2)
    assert_parity(reference, result, loss_rtol=2e-2, param_atol=2e-2)
    with pytest.raises(AssertionError):
        assert_parity(reference, result)


def test_convert_zero3_checkpoint_to_hugging_face(base, tmp_path):
    """A ZeRO-3 checkpoint from 2 ranks becomes an HF folder in one process, with identical weights."""
    transformers = pytest.importorskip("transformers")
    import torch

    from fivefold.cli import main
    from fivefold.model.hf import load_hf

    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "z3")},
                          data_parallel={"shard": 2, "zero_stage": 3})
    _, weights = train_distributed(config, 2)
    assert main(["convert", "--checkpoint", str(tmp_path / "z3"), "--to", str(tmp_path / "hf")]) == 0
    converted = load_hf(tmp_path / "hf").state_dict()
    for name, tensor in weights.items():
        assert torch.equal(converted[name], tensor), name
    assert transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf") is not None
    assert (tmp_path / "hf" / "tokenizer.txt").is_file()
