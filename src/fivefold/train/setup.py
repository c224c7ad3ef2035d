"""What a rank sets up before its model: the device, its CPU threads, the data, the model's vocabulary.

Threads: PyTorch starts one intra-op thread per core it sees. With several ranks on one machine,
or a container that may use fewer cores than the machine has, that oversubscribes the cores and
the OpenMP threads spin against each other (a run 10x slower is usual). Each rank takes
`train.threads`, or the cores this process may use (its CPU affinity and the cgroup's CPU quota)
divided by the ranks on this machine, at least 1, so ranks x threads <= cores.

Data: rank 0 builds the token cache (tokenising, or training a BPE tokenizer, can take minutes on
a large corpus); the other ranks wait for it on the rendezvous store, not in a collective, so the
wait is not cut short by the collective timeout, and the heartbeat reports what they wait for.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from fivefold.config import JobConfig
from fivefold.data.dataset import PreparedData, prepare_data
from fivefold.errors import ConfigError
from fivefold.model import ModelConfig
from fivefold.train.rendezvous import announce, wait_for


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda but no CUDA device is available; use auto or cpu")
    return torch.device(name)


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (v2 or v1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = None
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if limit != "max":
            quota = int(limit) / int(period)
    except (OSError, ValueError):
        try:
            limit = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
            period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
            quota = limit / period if limit > 0 else None
        except (OSError, ValueError):
            pass
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def threads_per_rank(configured: int) -> int:
    if configured > 0:
        return configured
    return max(1, available_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def cap_threads(configured: int) -> int:
    """Set this rank's intra-op threads (train.threads, or cores / local ranks); returns the number."""
    threads = threads_per_rank(configured)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def _silent(text: str) -> None:
    pass


def rank0_printer(is_rank0: bool) -> Callable[[str], None]:
    """Rank 0's printer (tqdm.write: progress bars stay whole); the other ranks print nothing. A plain function,
    so the trainer's parts can keep it without keeping the trainer alive."""
    return tqdm.write if is_rank0 else _silent


def resolve_model_config(model: ModelConfig, vocab_size: int) -> ModelConfig:
    """Fill in the tokenizer's vocabulary size, or check the configured one can hold it."""
    if model.vocab_size == 0:
        return dataclasses.replace(model, vocab_size=vocab_size)
    if model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size = {model.vocab_size} is smaller than the tokenizer's {vocab_size}: "
            "set model.vocab_size = 0 to take the tokenizer's"
        )
    return model


def prepare_data_once(config: JobConfig, world_size: int, is_rank0: bool, key: str = "",
                      log: Callable[[str], None] | None = None) -> PreparedData:
    """Rank 0 builds the token cache; the others wait on the rendezvous store, then open it."""
    if world_size > 1 and not is_rank0:
        wait_for("data-ready", key, "waiting for rank 0 to prepare the data")
        return prepare_data(config.data)
    data = prepare_data(config.data, log)
    if world_size > 1:
        announce("data-ready", key)
    return data
