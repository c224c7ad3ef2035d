"""Checkpoints through torch.distributed.checkpoint: exact resume, and resume under another layout.

A checkpoint stores weights and AdamW moments per flat group, unpadded (train/train_state.py),
so it does not depend on the shard count. Saved at ZeRO-3 x 4 ranks, it resumes at ZeRO-2 x 2
ranks, in one process, and under DDP, and the remaining steps give the uninterrupted run's
losses (up to summation order: the parity tolerances of harness.py). Tensor- and
context-parallel runs resume exactly (another tp or pp degree: test_layout_resume.py); a context-parallel ZeRO checkpoint (sharded over the cp
ranks) resumes in one process.
"""

from pathlib import Path

import pytest
import torch

from distributed.spawn import run_distributed
from parity.harness import _weights, assert_parity, train_distributed, train_single, with_changes


def _interrupted_then_resumed(rank, world_size, config):
    """2 steps, save, then a fresh Trainer resumes and finishes: the losses of both halves."""
    from fivefold.train.trainer import Trainer

    first = Trainer(config)
    losses = [first.train_step()["loss"] for _ in range(2)]
    first.save()
    del first
    resumed = Trainer(with_changes(config, checkpoint={"resume": "auto"}))
    result = resumed.fit()
    return losses + result.losses, str(result.checkpoint)


def _assert_resume_is_exact(config, tmp_path) -> tuple[Path, tuple]:
    """Straight 2-rank run vs 2 steps + save + fresh resume: identical losses and weights.

    Returns the resumed run's final checkpoint and the straight run's (losses, weights).
    """
    straight_losses, straight_weights = train_distributed(config, 2)
    resumed = with_changes(config, train={"output_dir": str(tmp_path / "resumed")})
    (losses, folder), _ = run_distributed(_interrupted_then_resumed, 2, resumed, timeout=150)
    assert losses == straight_losses
    for name, tensor in _weights(Path(folder)).items():
        assert torch.equal(tensor, straight_weights[name]), name
    return Path(folder), (straight_losses, straight_weights)


@pytest.mark.parametrize("stage,param_dtype", [(2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_zero_resume_is_exact(base, tmp_path, stage, param_dtype):
    """Save at step 2 of 4, each rank writing its own shards; resume gives the uninterrupted run bit for bit.

    With bf16 compute weights the fp32 masters are restored from the checkpoint, not from the bf16 copy.
    """
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "straight")},
                          data_parallel={"shard": 2, "zero_stage": stage, "param_dtype": param_dtype})
    folder, _ = _assert_resume_is_exact(config, tmp_path)
    state = folder / "state"
    assert {p.name for p in state.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # one file per rank


def test_reshard_zero3_x4_to_zero2_x2_single_process_and_ddp(base, tmp_path):
    """Save at dp_shard = 4 (ZeRO-3), resume at dp_shard = 2 (ZeRO-2), in one process, and under DDP x 2."""
    saved = with_changes(base, train={"micro_batch_size": 2, "output_dir": str(tmp_path / "x4")},
                         data_parallel={"shard": 4, "zero_stage": 3}, checkpoint={"every": 2, "keep_last": 2})
    straight = train_distributed(saved, 4)
    midpoint = tmp_path / "x4" / "step-000002"
    shards = sorted(p.name for p in (midpoint / "state").glob("*.distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]

    def resume(name, world_size, **data_parallel):
        config = with_changes(base, train={"micro_batch_size": 8 // world_size, "output_dir": str(tmp_path / name)},
                              data_parallel=data_parallel, checkpoint={"resume": str(midpoint)})
        losses, weights = train_single(config) if world_size == 1 else train_distributed(config, world_size)
        return straight[0][:2] + losses, weights  # the first two steps are the saved run's

    for result in (resume("x2", 2, shard=2, zero_stage=2), resume("x1", 1), resume("ddp", 2)):
        diffs = assert_parity(straight, result)
        print(f"resharded: {diffs}")


def test_tensor_parallel_resume_is_exact(base, tmp_path):
    """tp 2 (with SP): save at step 2, resume: the uninterrupted run bit for bit (other tp degrees:
    test_layout_resume.py)."""
    config = with_changes(base, train={"output_dir": str(tmp_path / "straight")},
                          tensor_parallel={"degree": 2, "sequence_parallel": True})
    _assert_resume_is_exact(config, tmp_path)


def test_context_parallel_zero3_resume_is_exact_and_resumes_in_one_process(base, tmp_path):
    """cp 2 ring with ZeRO-3 sharding over the two cp ranks: exact resume; the checkpoint also resumes in one process."""
    from parity.harness import CP_PARAM_ATOL

    config = with_changes(base, train={"output_dir": str(tmp_path / "straight")},
                          context_parallel={"degree": 2}, data_parallel={"zero_stage": 3}, checkpoint={"every": 2, "keep_last": 2})
    folder, straight = _assert_resume_is_exact(config, tmp_path)
    assert {p.name for p in (folder / "state").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    single = with_changes(base, train={"output_dir": str(tmp_path / "one")},
                          checkpoint={"resume": str(tmp_path / "straight" / "step-000002")})
    losses, weights = train_single(single)
    diffs = assert_parity(straight, (straight[0][:2] + losses, weights), param_atol=CP_PARAM_ATOL)
    print(f"cp2 zero3 -> one process: {diffs}")
