"""Process-group set-up from the environment torchrun provides (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

NCCL when CUDA is available, gloo otherwise. A single process without those variables runs
without a process group at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def read_env() -> DistEnv:
    return DistEnv(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> DistEnv:
    """Join the process group if this is a multi-process run (idempotent)."""
    env = read_env()
    if env.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return env


def local_device(device: torch.device, env: DistEnv) -> torch.device:
    """One GPU per local rank; CPU ranks share the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return device


def all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum a tensor over `group` in place (no-op without a group)."""
    if group is not None:
        dist.all_reduce(value, group=group)
    return value
