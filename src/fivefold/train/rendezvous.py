"""Rank 0 tells the other ranks that something they wait for is done, through torchrun's rendezvous store.

Used where the other ranks must not go on before rank 0 has finished a piece of work on shared files, and
no collective is at hand (they are in other groups, or a collective would hold every rank's thread): the token
cache rank 0 builds (`prepare_data_once`), and the output folder rank 0 claims for the run (train/checkpointing.py
removes an earlier run's files; parameter servers must not start their heartbeats and event logs in it before).
Keys carry the attempt's id, so a restarted attempt waits for its own rank 0. In one process nothing waits.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from fivefold.reliability.activity import phase


def _key(name: str, attempt: str) -> str:
    return f"fivefold/{name}/{attempt}"


def announce(name: str, attempt: str) -> None:
    """Rank 0: `name` is done for this attempt."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.distributed_c10d._get_default_store().set(_key(name, attempt), "1")


def wait_for(name: str, attempt: str, doing: str) -> None:
    """Wait (in the activity phase `doing`, which the watchdog reports) until rank 0 announces `name`."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    store = dist.distributed_c10d._get_default_store()
    with phase(doing):
        while not store.check([_key(name, attempt)]):
            time.sleep(0.2)
