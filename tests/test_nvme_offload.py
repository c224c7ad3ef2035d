"""NVMe offload (parallel/nvme_offload.py): the pipelined swap step is torch's AdamW, bitwise; the file and
host-memory sizes are the formula's; a changed swap file, a full disk and a bad directory are refused."""

import os
from types import SimpleNamespace

import pytest
import torch

from fivefold.config import OptimConfig
from fivefold.errors import ConfigError
from fivefold.optim import build_adamw
from fivefold.parallel import nvme_offload
from fivefold.parallel.nvme_offload import NvmeOptimizer, OffloadCorruptError
from fivefold.plan.memory import nvme_file_bytes, nvme_host_bytes

# Sizes around a page and over one I/O chunk (8 MiB / 3 states: the largest group takes two chunks)
SIZES = [(1000, True), (7, False), (1024, True), (700_001, True), (33, False)]
CONFIG = OptimConfig(lr=1e-2, weight_decay=0.1)


class _Zero:
    """What the optimizer needs of a ZeRO instance: each group's compute shard."""

    def __init__(self):
        self.shards = {}

    def compute_shard(self, g):
        return self.shards[id(g)]


def _groups(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    zero, pairs = _Zero(), []
    for numel, decay in SIZES:
        g = SimpleNamespace(shard_numel=numel, decay=decay, grad_shard=None)
        zero.shards[id(g)] = torch.randn(numel, generator=generator)
        pairs.append((zero, g))
    return zero, pairs


def _optimizer(pairs, directory, piece_numel: int = 1 << 24):
    return NvmeOptimizer(pairs, str(directory), lambda decay, no_decay: build_adamw(decay, no_decay, CONFIG), rank=0,
                         piece_numel=piece_numel)


@pytest.mark.parametrize("piece_numel", [1 << 24, 1000], ids=["whole-groups", "pieces-of-1000"])
def test_swapped_steps_equal_in_memory_adamw_bitwise(tmp_path, piece_numel):
    zero, pairs = _groups()
    masters = [torch.nn.Parameter(zero.compute_shard(g).clone()) for _, g in pairs]
    reference = build_adamw([m for m, (_, g) in zip(masters, pairs) if g.decay],
                            [m for m, (_, g) in zip(masters, pairs) if not g.decay], CONFIG)
    swapped = _optimizer(pairs, tmp_path, piece_numel)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        for master, (_, g) in zip(masters, pairs):
            g.grad_shard = torch.randn(g.shard_numel, generator=generator)
            master.grad = g.grad_shard.clone()
        for group in [*reference.param_groups, *swapped.param_groups]:
            group["lr"] = 1e-2 / (step + 1)  # the schedule sets param_groups, as for any optimizer
        reference.step()
        swapped.step()
    for index, (master, (_, g)) in enumerate(zip(masters, pairs)):
        assert torch.equal(zero.compute_shard(g), master.detach())
        states, step = swapped.load(index)
        assert step == 3.0
        assert torch.equal(states["master"], master.detach())
        assert torch.equal(states["exp_avg"], reference.state[master]["exp_avg"])
        assert torch.equal(states["exp_avg_sq"], reference.state[master]["exp_avg_sq"])
    numels = [n for n, _ in SIZES]
    file_bytes = nvme_file_bytes(numels, piece_numel)
    assert os.path.getsize(swapped.path) == swapped.file_bytes == file_bytes
    assert sum(t.numel() for t in swapped.host_tensors()) == nvme_host_bytes(numels, piece_numel)
    assert len(swapped.pieces) == sum(-(-n // piece_numel) for n in numels)
    assert swapped.bytes_read >= 3 * file_bytes and swapped.bytes_written >= 3 * file_bytes
    directory = swapped.directory
    swapped.close()
    assert not os.path.exists(directory)


def test_a_changed_swap_file_stops_the_step(tmp_path):
    zero, pairs = _groups()
    swapped = _optimizer(pairs, tmp_path)
    offset = swapped.pieces[3].offset + 4 * 1000
    with open(swapped.path, "r+b") as f:  # one bit flipped in group 3's master
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    for _, g in pairs:
        g.grad_shard = torch.ones(g.shard_numel)
    with pytest.raises(OffloadCorruptError, match="checksum mismatch.*resume from the last checkpoint"):
        swapped.step()
    swapped.close()


def test_a_full_disk_or_missing_directory_fails_at_start(tmp_path, monkeypatch):
    _, pairs = _groups()
    with pytest.raises(ConfigError, match="data_parallel.nvme_path .* is not a writable directory"):
        _optimizer(pairs, tmp_path / "absent")

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme_offload.os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="cannot reserve .* GiB free; No space left on device"):
        _optimizer(pairs, tmp_path)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_config_needs_offload(job):
    import dataclasses

    job.data_parallel = dataclasses.replace(job.data_parallel, shard=2, zero_stage=2, nvme_path="/tmp")
    with pytest.raises(ConfigError, match="set data_parallel.offload = true"):
        job.validate()
    job.data_parallel.offload = True
    job.validate()


def test_the_launcher_refuses_a_missing_nvme_path_before_any_rank_starts(job, tmp_path):
    import dataclasses

    from fivefold.train.launch import check_before_launch

    job.data_parallel = dataclasses.replace(job.data_parallel, shard=2, zero_stage=2, offload=True,
                                            nvme_path=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="data_parallel.nvme_path .* is not a writable directory"):
        check_before_launch(job.validate(), 2)
    job.data_parallel.nvme_path = str(tmp_path)
    check_before_launch(job.validate(), 2)
