"""Asynchronous checkpoints (issue item 8): the same checkpoints as synchronous saves, written while
training goes on, host memory flat over 100 saves, and a failed write that leaves the earlier ones valid.

The distributed path (a background thread on a process group of its own, ZeRO DTensor shards) runs
in tests/distributed/test_faults.py (the --max-restarts job saves asynchronously).
"""

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from fivefold.errors import CheckpointError
from fivefold.train.checkpoint import list_checkpoints, read_weights, verify_checkpoint
from fivefold.train.trainer import Trainer


def change(job, **sections):
    out = dataclasses.replace(job)
    for section, values in sections.items():
        setattr(out, section, dataclasses.replace(getattr(out, section), **values))
    return out.validate()


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_async_checkpoints_equal_synchronous_ones(job, tmp_path):
    sync = Trainer(change(job, checkpoint={"every": 2, "keep_last": 3})).fit()
    async_ = Trainer(change(job, checkpoint={"every": 2, "keep_last": 3, "async_save": True},
                            train={"output_dir": str(tmp_path / "async")})).fit()
    assert async_.losses == sync.losses
    for a, s in zip(list_checkpoints(tmp_path / "async"), list_checkpoints(job.train.output_dir), strict=True):
        verify_checkpoint(a)
        weights = read_weights(a)
        assert all(torch.equal(weights[k], v) for k, v in read_weights(s).items()), a.name


def test_training_goes_on_while_a_save_is_written(job):
    release = threading.Event()
    trainer = Trainer(change(job, checkpoint={"every": 0, "async_save": True}))
    trainer.train_step()
    trainer.save()
    trainer.checkpoints.wait()  # the first save is written: the hook below holds only the next one
    trainer.checkpoints.writer.before_write = lambda folder, step: release.wait(30)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.state.step += 1
    saved = trainer.save()  # captured; the write waits for `release`
    assert trainer.checkpoints.writer.in_flight
    trainer.train_step()  # training goes on and changes the weights the save captured
    release.set()
    assert trainer.checkpoints.wait() == saved
    weights = read_weights(saved)
    assert all(torch.equal(weights[k], before[k].cpu()) for k in weights)  # the save holds the state at capture


@pytest.mark.slow
def test_host_memory_stays_flat_over_a_hundred_saves(job):
    """About 6.5 MB of state per save: a copy kept per save would add 600 MB over 100 saves."""
    config = change(job, model={"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2},
                    checkpoint={"every": 0, "async_save": True, "keep_last": 2})
    trainer = Trainer(config)
    trainer.train_step()
    for _ in range(10):
        trainer.state.step += 1
        trainer.save()
    trainer.checkpoints.wait()
    staged, start = trainer.checkpoints.writer.staging.bytes, resident_bytes()
    for _ in range(90):
        trainer.state.step += 1
        trainer.save()
    trainer.checkpoints.wait()
    growth = resident_bytes() - start
    assert staged > 5e6 and trainer.checkpoints.writer.staging.bytes == staged  # buffers reused, never added
    assert growth < 64e6, f"resident memory grew by {growth / 1e6:.0f} MB over 90 saves"
    assert len(list_checkpoints(config.train.output_dir)) == 2


def test_a_failed_background_write_leaves_the_earlier_checkpoints_valid(job):
    config = change(job, checkpoint={"every": 2, "async_save": True}, fault={"kind": "disk_full", "step": 4})
    with pytest.raises(CheckpointError, match=r"step-000004 failed: OSError: \[Errno 28\] No space left on device"):
        Trainer(config).fit()  # raised where the next save (or the end) waits for it
    out = Path(config.train.output_dir)
    assert [p.name for p in list_checkpoints(out)] == ["step-000002"]
    verify_checkpoint(out / "step-000002")
    resumed = Trainer(change(config, checkpoint={"resume": "auto"}, fault={"kind": "none"})).fit()
    assert resumed.steps == 6 and not list(out.glob(".tmp-*"))  # the leftover of the failed write is gone
