"""The training state through torch.distributed.checkpoint (DCP): write, restore, consolidate.

The tensors and their keys come from the gradient sync (`GradientSync.state_dict`, keys from
parallel/checkpoint_layout.py): whole flat groups on every rank without ZeRO, this rank's shard
as a DTensor under ZeRO. DCP writes each rank's part in parallel and reads back whatever the
current layout's tensors cover, which makes resharding across data-parallel layouts free: a
checkpoint saved with ZeRO at dp_shard = 4 resumes at dp_shard = 2, under DDP, or in one process.
Pipeline stages need nothing: group names are global, so any pp degree reads any other's groups.

A different tensor-parallel degree cannot be read piece for piece (a tp 2 piece is not a tp 4
piece), so it goes through whole tensors: every parameter and both AdamW moments are put back
together from the saved pieces (`read_consolidated`), and this rank's piece is cut out of them
(`checkpoint_layout.tp_piece`); AdamW's moments are element-wise, so they split exactly like the
weights. Each rank reads the whole model's state for this, once, at resume.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fivefold.parallel.checkpoint_layout import MOMENTS, CheckpointLayout, consolidate, tp_piece
from fivefold.parallel.flat_groups import flatten, unflatten
from fivefold.parallel.gradient_sync import GradientSync
from fivefold.parallel.parallelize import Parallelized


@contextlib.contextmanager
def _single_process():
    """DCP warns on every single-process save/load; that is our intent, not a problem."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write_training_state(state: dict[str, torch.Tensor], folder: Path, distributed: bool,
                         group: dist.ProcessGroup | None = None) -> None:
    """Write this rank's part of the state into `folder` (collective over `group` when distributed)."""
    with _single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=not distributed, process_group=group)


def capture_training_state(parallel: Parallelized) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint state dict (every rank of a distributed run calls DCP with it)."""
    return parallel.sync.state_dict(parallel.folds.checkpoint_tp_rank)


@torch.no_grad()
def restore_training_state(folder: Path, parallel: Parallelized, saved: CheckpointLayout) -> None:
    """Load weights and AdamW state saved under any layout into this one (collective under ZeRO)."""
    sync, tp_rank = parallel.sync, parallel.folds.checkpoint_tp_rank
    if saved.tp == parallel.layout.tp:
        restore_sync_state(folder / "state", sync, tp_rank)
        return
    whole = read_consolidated(folder, saved, ("model", *MOMENTS))
    steps = read_steps(folder, saved)
    tp, rank = parallel.folds.tp, parallel.folds.tp_rank
    pieces = {}
    for key, entry in parallel.local_layout.pieces.items():
        pieces[key.group] = {
            kind: flatten([tp_piece(whole[kind][name], spec, tp, rank, shape)
                           for name, shape, spec in zip(entry.names, entry.shapes, entry.specs)])
            for kind in ("model", *MOMENTS)
        }
        pieces[key.group]["step"] = steps[key.group]
    sync.load_pieces(pieces)


def restore_sync_state(state_folder: Path, sync: GradientSync, tp_rank: int | None) -> None:
    """Same tensor-parallel degree: DCP reads straight into the sync's own tensors (collective under ZeRO)."""
    state = sync.state_dict(tp_rank, fresh=True)  # buffers of the right shapes, filled in place by DCP
    with _single_process():
        dcp.load(state, checkpoint_id=str(state_folder), no_dist=not sync.collective_checkpoint)
    sync.load_state_dict(state, tp_rank)


def read_steps(folder: Path, layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """AdamW's step count of every group (the same on every TP piece)."""
    keys = {key.group: key.tensor("step") for key in sorted(layout.pieces)}
    state = {name: torch.zeros((), dtype=torch.float32) for name in keys.values()}
    with _single_process():
        dcp.load(state, checkpoint_id=str(folder / "state"), no_dist=True)
    return {group: state[name] for group, name in keys.items()}


def read_consolidated(folder: Path, layout: CheckpointLayout, kinds: tuple[str, ...] = ("model",)) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> every parameter whole (fp32), from a checkpoint saved under any layout; one process, no group."""
    reader = dcp.FileSystemReader(str(folder / "state"))
    stored = reader.read_metadata().state_dict_metadata
    flats = {key.tensor(kind): torch.empty(stored[key.tensor(kind)].size, dtype=torch.float32)
             for key in layout.pieces for kind in kinds}
    with _single_process():
        dcp.load(flats, storage_reader=reader, no_dist=True)
    out = {}
    for kind in kinds:
        pieces: dict[str, dict[int | None, torch.Tensor]] = {}
        specs = {}
        for key, entry in layout.pieces.items():
            values = unflatten(entry.group(key.group), flats[key.tensor(kind)])
            for (name, tensor), spec in zip(values.items(), entry.specs):
                pieces.setdefault(name, {})[key.tp_rank] = tensor
                specs[name] = spec
        out[kind] = consolidate(pieces, specs)
    return out


def read_consolidated_weights(folder: Path, layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """Every parameter whole, fp32, from a checkpoint saved under any layout; one process, no group."""
    return read_consolidated(folder, layout)["model"]

