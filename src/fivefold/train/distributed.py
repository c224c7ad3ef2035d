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

from fivefold.reliability.activity import phase


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


STARTUP_TIMEOUT = timedelta(minutes=10)


def init_distributed(device: torch.device, timeout: timedelta = timedelta(seconds=600)) -> DistEnv:
    """Join the process group if this is a multi-process run (idempotent); `timeout` bounds every collective.

    Joining waits up to STARTUP_TIMEOUT (or `timeout`, if longer) for the other ranks, which may start
    seconds or minutes apart (imports, a busy node, a restart); only then does the collective timeout apply.
    """
    env = read_env()
    if env.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        startup = max(timeout, STARTUP_TIMEOUT)
        store = attempt_store(env, startup)
        if store is None:
            dist.init_process_group(backend, timeout=startup)
        else:
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=startup)
        dist.group.WORLD.set_timeout(timeout)
    return env


def attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store | None:
    """Under torchrun, the rendezvous store with keys private to this restart attempt (None otherwise).

    torchrun's agent keeps one store for all attempts of a job, and a restarted worker can read the
    address a worker of the previous attempt published and fail to connect to it ("Connection refused",
    pytorch/pytorch#167288). Prefixing every key with the attempt number keeps the attempts apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=not agent and env.rank == 0, timeout=timeout, multi_tenant=not agent)
    return dist.PrefixStore(f"fivefold/attempt-{attempt}/", store)


def local_device(device: torch.device, env: DistEnv) -> torch.device:
    """One GPU per local rank; CPU ranks share the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return device


def all_reduce_sum(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum a tensor over `group` in place (no-op without a group)."""
    if group is not None:
        with phase("token-count all-reduce", comm=True):
            dist.all_reduce(value, group=group)
    return value
