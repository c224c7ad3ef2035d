"""Writing checkpoints: atomic, checksummed, on the training thread or in the background.

One save, in every rank of the trainer group:

    capture     on the training thread: the DCP state (this rank's tensors), and on the
                coordinator the small files (layout, trainer state, RNG, config, tokenizer)
    write       DCP writes each rank's shards into `.tmp-step-N/state` (files fsynced); each rank
                hashes the files it wrote and the coordinator gathers the hashes, writes the small
                files, then the manifest `meta.json` last (reliability/manifest.py)
    publish     the coordinator fsyncs, renames `.tmp-step-N` to `step-N` (an existing `step-N` is
                moved aside first and deleted after), fsyncs the run folder, prunes old checkpoints

A crash at any point leaves the previous checkpoints untouched and at most a `.tmp-*` folder,
which is never read and is removed at the next save.

`checkpoint.async_save = true` (Nebula / torch DCP `async_save` style): capture copies every
tensor into host buffers that are allocated once and reused (so host memory stays flat over any
number of saves), the write and publish steps run on a background thread over a process group of
their own (so they never interleave with the training thread's collectives), and training goes on.
The next save, a rollback, evaluation of the final result and the end of training wait for the
write in flight; an error in it is raised there.
"""

from __future__ import annotations

import concurrent.futures
import errno
import io
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from fivefold.errors import CheckpointError
from fivefold.parallel.checkpoint_layout import CheckpointLayout
from fivefold.reliability.manifest import file_entry, write_file, write_manifest
from fivefold.train.checkpoint import (
    FORMAT_VERSION,
    TrainerState,
    checkpoint_name,
    prune_checkpoints,
    temporary_folder,
)
from fivefold.train.train_state import write_training_state


@dataclass
class Snapshot:
    """One checkpoint's content, captured on the training thread."""

    step: int
    state: dict[str, torch.Tensor]
    files: dict[str, bytes]  # coordinator only: small files by relative name


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files `tokenizer.save(folder)` writes, as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(Path(tmp))
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def rng_bytes() -> bytes:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    buffer = io.BytesIO()
    torch.save(rng, buffer)
    return buffer.getvalue()


def _fsync_dirs(folder: Path) -> None:
    """fsync every folder below and including `folder` (file contents are fsynced as they are written)."""
    for path in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException."""
    if isinstance(exc, dcp.api.CheckpointException):
        first = next(iter(exc.failures.values()), None)
        return first[0] if isinstance(first, tuple) else (first or exc)
    return exc


class HostStaging:
    """Host copies of a state dict's tensors in buffers allocated once and reused by every save."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, on_gpu = {}, False
        for name, tensor in state.items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                self.buffers[name] = buffer
            buffer.copy_(local.detach(), non_blocking=local.is_cuda)
            on_gpu |= local.is_cuda
            out[name] = (DTensor.from_local(buffer, tensor.device_mesh, tensor.placements, run_check=False,
                                            shape=tensor.shape, stride=tensor.stride())
                         if isinstance(tensor, DTensor) else buffer)
        if on_gpu:
            torch.cuda.synchronize()
        return out

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class CheckpointWriter:
    """Saves checkpoints of one run into `output_dir` (every rank of `group` calls `save` together)."""

    def __init__(self, output_dir: Path, keep_last: int, run_id: str, group: dist.ProcessGroup | None,
                 distributed: bool, async_save: bool = False, background_group: dist.ProcessGroup | None = None,
                 before_write: Callable[[Path, int], None] | None = None,
                 after_write: Callable[[Path, int], None] | None = None):
        self.output_dir, self.keep_last, self.run_id = Path(output_dir), keep_last, run_id
        self.distributed, self.async_save = distributed, async_save
        # the background thread's collectives need a group the training thread never uses
        self.group = background_group if async_save and distributed else group
        self.rank = dist.get_rank(self.group) if distributed else 0
        self.coordinator = self.rank == 0
        self.before_write, self.after_write = before_write, after_write
        self.staging = HostStaging() if async_save else None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "fivefold-checkpoint") if async_save else None
        self._future: concurrent.futures.Future | None = None
        self._tokenizer_files: dict[str, bytes] | None = None
        self.last_saved: Path | None = None
        self.stall_seconds: list[float] = []  # time the training thread spent in each save call

    # ------------------------------------------------------------------ the training thread
    def save(self, state: dict[str, torch.Tensor], layout: CheckpointLayout, trainer_state: TrainerState,
             config: dict[str, Any], tokenizer) -> Path:
        """Write checkpoint `step-N` (N = trainer_state.step); with async_save, return once it is captured."""
        start = time.perf_counter()
        self.wait()
        if self.staging is not None:
            state = self.staging.stage(state)
        files: dict[str, bytes] = {}
        if self.coordinator:
            if self._tokenizer_files is None:
                self._tokenizer_files = tokenizer_files(tokenizer)
            files = {"layout.json": json.dumps(layout.to_json(), indent=1).encode(),
                     "trainer.json": json.dumps(trainer_state.__dict__, indent=2).encode(),
                     "config.json": json.dumps(config, indent=2, sort_keys=True).encode(),
                     "rng.pt": rng_bytes(), **self._tokenizer_files}
        snapshot = Snapshot(trainer_state.step, state, files)
        final = self.output_dir / checkpoint_name(snapshot.step)
        if self._executor is not None:
            self._future = self._executor.submit(self._write, snapshot)
        else:
            self._write(snapshot)
        self.stall_seconds.append(time.perf_counter() - start)
        return final

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is published; raise its error. Returns the newest saved."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()
        return self.last_saved

    @property
    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the write (either thread)
    def _write(self, snap: Snapshot) -> Path:
        final = self.output_dir / checkpoint_name(snap.step)
        try:
            return self._write_unwrapped(snap, final)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of a save is reported as one
            cause = _cause(exc)
            hint = (" (the disk is full: free space or lower checkpoint.keep_last)"
                    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC else "")
            raise CheckpointError(f"saving checkpoint {final} failed: {type(cause).__name__}: {cause}{hint}; "
                                  "the earlier checkpoints are intact") from exc

    def _write_unwrapped(self, snap: Snapshot, final: Path) -> Path:
        tmp = temporary_folder(self.output_dir, snap.step)
        if self.coordinator:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "state").mkdir(parents=True)
        self._barrier()
        if self.before_write is not None:
            self.before_write(tmp, snap.step)
        write_training_state(snap.state, tmp / "state", self.distributed, self.group)
        mine = {f"state/{p.name}": file_entry(p) for p in (tmp / "state").glob(f"__{self.rank}_*.distcp")}
        entries = self._gather(mine)
        if self.coordinator:
            for name, data in snap.files.items():
                write_file(tmp / name, data)
            body = {"format": FORMAT_VERSION, "step": snap.step, "run_id": self.run_id, "written_at": time.time()}
            write_manifest(tmp, body, known={k: v for part in entries for k, v in part.items()})
            _fsync_dirs(tmp)
            self._publish(tmp, final)
        self._barrier()  # nobody reads the checkpoint list before the rename
        self.last_saved = final
        if self.after_write is not None:
            self.after_write(final, snap.step)
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        old = final.with_name(f".old-{final.name}")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dirs_only(self.output_dir)
        if old.exists():
            shutil.rmtree(old)
        prune_checkpoints(self.output_dir, self.keep_last, self.run_id)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _gather(self, mine: dict[str, dict]) -> list[dict[str, dict]]:
        if not self.distributed:
            return [mine]
        parts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, mine, group=self.group)
        return parts


def _fsync_dirs_only(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
