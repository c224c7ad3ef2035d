"""Run a function in `world_size` gloo ranks on 127.0.0.1 and collect what each returns.

A rank that raises fails the test with that rank's traceback; a run that does not finish
within `timeout` seconds is killed and fails, so a hang costs seconds, not the CI budget.

Ranks are forked from a forkserver that imported torch and fivefold once for the whole session:
a fresh interpreter spends about 5 s importing them on the 2-core CI machine, several times the
work of a test's few training steps. A forked rank starts with no process group and no state of
its own beyond those imports, like a spawned one.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            _leave_together(dist, world_size)
            dist.destroy_process_group()


def _leave_together(dist, world_size: int, timeout: float = 60.0) -> None:
    """Rank 0 hosts the rendezvous store: it stays until every rank is done with it.

    Otherwise a rank still creating process groups (which talks to the store) can find it gone
    ("Connection reset by peer") when rank 0 finished its own part first.
    """
    import time

    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("spawn/left", 1)
        if dist.get_rank() == 0:
            deadline = time.monotonic() + timeout
            while store.add("spawn/left", 0) < world_size and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a rank that died took the store with it; nothing to wait for
        pass


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        # torch._dynamo: the first parameter initialised on the meta device (every model build) imports it
        # lazily, 1.7 s of CPU per rank on the CI machine; imported once here, every forked rank has it
        _CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "fivefold.train.roles",
                                         "distributed.spawn"])
    return _CONTEXT


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """fn(rank, world_size, *args) in each rank; returns the results ordered by rank.

    Results cross a process boundary: return plain Python values or paths, not tensors
    (shared-memory tensors die with the rank that made them).
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_module.Empty as exc:
                raise TimeoutError(f"distributed run timed out after {timeout}s; ranks done: {sorted(results)}") from exc
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
