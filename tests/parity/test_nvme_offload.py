"""ZeRO-Offload in host memory and on a drive (NVMe, ZeRO-Infinity) reproduce single-process training.

The NVMe optimizer runs torch's AdamW group by group on states read back from the swap file, so
its losses and weights are bitwise those of the in-memory offload (here with groups cut in pieces of
512 elements, several per group); both match one process at the
harness's tolerances. A checkpoint written from the swap file resumes exactly, in memory or on NVMe.
"""

import os

import torch

from parity.harness import assert_parity, train_distributed, train_single, with_changes


def test_zero3_offload_in_memory_and_on_nvme(base, tmp_path):
    reference = train_single(base)
    nvme = tmp_path / "drive"
    nvme.mkdir()
    runs = {}
    for name, extra in (("cpu", {}), ("nvme", {"nvme_path": str(nvme), "nvme_sub_group": 512})):
        zero = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / name)},
                            data_parallel={"shard": 2, "zero_stage": 3, "offload": True, **extra})
        runs[name] = train_distributed(zero, 2)
        assert_parity(reference, runs[name])
    assert runs["nvme"][0] == runs["cpu"][0]
    for key, value in runs["cpu"][1].items():
        assert torch.equal(runs["nvme"][1][key], value), key
    assert os.listdir(nvme) == []  # each rank's swap directory is removed when the run ends


def test_nvme_offload_checkpoint_resumes_exactly(base, tmp_path):
    """ZeRO-1 over 2 ranks, mixed precision: a run with its states on NVMe saves at step 2 and goes on to 4;
    a run resuming step 2 (states on NVMe again) continues with the same losses and weights."""
    nvme = tmp_path / "drive"
    nvme.mkdir()
    dp = {"shard": 2, "zero_stage": 1, "offload": True, "param_dtype": "bf16", "nvme_path": str(nvme)}
    first = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "saved")}, data_parallel=dp,
                         checkpoint={"every": 2, "keep_last": 2})
    straight = train_distributed(first, 2)
    again = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "resumed")}, data_parallel=dp,
                         checkpoint={"resume": str(tmp_path / "saved" / "step-000002")})
    losses, weights = train_distributed(again, 2)
    assert straight[0][2:] == losses
    for key, value in straight[1].items():
        assert torch.equal(weights[key], value), key
