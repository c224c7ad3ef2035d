"""Trainer.close releases what a trainer holds: its process groups, its heartbeat, its sync.

A process that builds trainers one after another (a notebook, a benchmark's dozens of layouts) keeps
every discarded trainer's gloo groups alive unless they are destroyed; hundreds of them made a 4-rank
step a third slower (parallel/mesh.py OwnedGroups). Closing one trainer must leave another one of the
same layout, alive beside it, able to train exactly as if the first had never existed.
"""

from __future__ import annotations

import dataclasses

import pytest

from distributed.spawn import run_distributed
from parity.harness import with_changes


def _live_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _two_trainers(rank: int, world_size: int, config, folder: str) -> dict:
    from fivefold.train.trainer import Trainer

    at_start = _live_groups()
    first = Trainer(with_changes(config, train={"output_dir": f"{folder}/first"}))
    owned = len(first._groups.groups)
    first.train_step()
    with Trainer(with_changes(config, train={"output_dir": f"{folder}/second"})) as second:
        both = _live_groups()
        first.close()
        after_first = _live_groups()
        heartbeat = first.supervisor.heartbeat
        if heartbeat is not None:
            heartbeat.join(timeout=10)
        losses = [second.train_step()["loss"] for _ in range(3)]
    closed_twice = first.close()
    try:
        first.train_step()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    with Trainer(with_changes(config, train={"output_dir": f"{folder}/alone"})) as alone:
        alone_losses = [alone.train_step()["loss"] for _ in range(3)]
    return {"owned": owned, "at_start": at_start, "both": both, "after_first": after_first,
            "at_end": _live_groups(), "heartbeat_alive": heartbeat is not None and heartbeat.is_alive(),
            "closed_twice": closed_twice, "refused": refused, "losses": losses, "alone_losses": alone_losses}


@pytest.mark.parametrize("layout", [
    {"context_parallel": {"degree": 2}},  # flattened mesh dimensions (dp_cp, dp_shard_cp)
    {"data_parallel": {"zero_stage": 3, "shard": 2}},  # ZeRO-3's own groups
])
def test_close_destroys_only_its_own_groups(job, tmp_path, layout):
    config = with_changes(job, checkpoint={"enabled": False}, train={"eval_every": 0}, **layout)
    results = run_distributed(_two_trainers, 2, config, str(tmp_path))
    for r in results:
        assert r["owned"] > 0
        assert r["both"] == r["at_start"] + 2 * r["owned"]
        assert r["after_first"] == r["at_start"] + r["owned"]  # the first trainer's groups, and only those, are gone
        assert r["at_end"] == r["at_start"]  # `with` closed the others
        assert not r["heartbeat_alive"]
        assert r["closed_twice"] is None
        assert "this Trainer is closed" in r["refused"]
        assert r["losses"] == r["alone_losses"]  # the survivor trains as if it had been alone
        assert all(loss == loss for loss in r["losses"])


def _fit_then_count(rank: int, world_size: int, config) -> tuple[int, int, bool]:
    from fivefold.train.trainer import Trainer

    at_start = _live_groups()
    trainer = Trainer(config)
    trainer.fit()
    return at_start, _live_groups(), trainer._closed


def test_fit_releases_its_groups(job):
    config = with_changes(dataclasses.replace(job), checkpoint={"enabled": False}, train={"steps": 2, "eval_every": 0},
                          context_parallel={"degree": 2})
    for at_start, at_end, closed in run_distributed(_fit_then_count, 2, config):
        assert closed and at_end == at_start


def _error_inside_with(rank: int, world_size: int, config, folder: str) -> dict:
    import torch

    from fivefold.train.trainer import Trainer

    moved = {}
    for ending in ("error", "normal"):
        trainer = Trainer(with_changes(config, train={"output_dir": f"{folder}/{ending}"}))
        try:
            with trainer:
                for _ in range(2):  # (the first step's report of model states applies its update at once)
                    trainer.train_step()  # its update waits, deferred to the next forward (the priority schedule)
                before = [p.detach().clone() for p in trainer.model.parameters()]
                if ending == "error":
                    raise ValueError("the caller's own error")
        except ValueError:
            pass
        moved[ending] = any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
        moved[f"{ending}_closed"] = trainer._closed
    return moved


def test_leaving_with_on_an_error_closes_without_collectives(job, tmp_path):
    """After an error a peer may never reach its own close: `with` then skips the deferred update (a collective)
    and still releases the rest; leaving it normally applies the update."""
    config = with_changes(job, checkpoint={"enabled": False}, train={"eval_every": 0, "max_grad_norm": 0.0},
                          gradient_comm={"schedule": "priority"})
    for r in run_distributed(_error_inside_with, 2, config, str(tmp_path)):
        assert r == {"error": False, "error_closed": True, "normal": True, "normal_closed": True}


def _dropped_after_close(rank: int, world_size: int, config) -> dict:
    import gc
    import threading
    import weakref

    import torch._dynamo  # noqa: F401 - torch imports it lazily on a first model build, from a frame cycle of its own

    from fivefold.train.trainer import Trainer

    gc.collect()
    gc.disable()
    try:
        trainer = Trainer(config)
        for _ in range(2):
            trainer.train_step()
        alive = [weakref.ref(x) for x in (trainer, trainer.model, next(trainer.model.parameters()), trainer.optimizer)]
        trainer.close()
        del trainer
        freed = [ref() is None for ref in alive]
    finally:
        gc.enable()
    threads = [t for t in threading.enumerate() if t.name.startswith("fivefold-comm")]
    for thread in threads:
        thread.join(timeout=10)
    return {"freed": freed, "comm_threads": sum(t.is_alive() for t in threads)}


@pytest.mark.parametrize("layout", [
    {"gradient_comm": {"allreduce_algorithm": "ring"}},  # DDP's hooks and its communication thread
    {"data_parallel": {"zero_stage": 3, "shard": 2}},  # ZeRO-3's gradient, module and backward hooks
    {"gradient_comm": {"schedule": "priority"}, "train": {"max_grad_norm": 0.0}},  # forward pre-hooks, deferred update
    {"context_parallel": {"degree": 2}},
])
def test_a_closed_trainer_is_freed_when_dropped(job, layout):
    """The sync's close detaches the hooks that point from the model's parameters and modules back at it and ends
    its communication thread: a dropped trainer frees its model and optimizer states at once, with no garbage
    collection (a benchmark or notebook building trainers one after another gets the memory back)."""
    extra = layout.get("train", {})
    config = with_changes(job, checkpoint={"enabled": False}, train={"eval_every": 0, **extra},
                          **{k: v for k, v in layout.items() if k != "train"})
    for r in run_distributed(_dropped_after_close, 2, config):
        assert r == {"freed": [True] * 4, "comm_threads": 0}
