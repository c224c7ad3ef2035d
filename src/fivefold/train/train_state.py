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

Every read goes through the checkpoint's manifest (`VerifiedReader`: each file is checked before
DCP reads it) and DCP's index is read without unpickling arbitrary objects (reliability/safe_dcp.py).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fivefold.errors import CheckpointError
from fivefold.parallel.checkpoint_layout import MOMENTS, CheckpointLayout, PieceRanks, consolidate, tp_piece
from fivefold.parallel.flat_groups import flatten, is_expert_group, unflatten
from fivefold.parallel.gradient_sync import GradientSync
from fivefold.parallel.parallelize import Parallelized
from fivefold.reliability.manifest import Manifest
from fivefold.reliability.safe_dcp import TensorOnlyLoadPlanner, VerifiedReader


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
    return parallel.sync.state_dict(parallel.piece_ranks)


@torch.no_grad()
def restore_training_state(manifest: Manifest, parallel: Parallelized, saved: CheckpointLayout) -> None:
    """Load weights and AdamW state saved under any layout into this one (collective under ZeRO)."""
    sync, ranks = parallel.sync, parallel.piece_ranks
    if saved.tp == parallel.layout.tp and saved.etp == parallel.layout.etp:
        restore_sync_state(manifest, sync, ranks)
        return
    whole = read_consolidated(manifest, saved, ("model", *MOMENTS))
    steps = read_steps(manifest, saved)
    experts = parallel.experts
    dense = (parallel.folds.tp, parallel.folds.tp_rank)
    expert = (experts.etp, experts.etp_rank) if experts is not None else (1, 0)
    pieces = {}
    for key, entry in parallel.local_layout.pieces.items():
        tp, rank = expert if is_expert_group(key.group) else dense
        pieces[key.group] = {
            kind: flatten([tp_piece(whole[kind][name], spec, tp, rank, shape)
                           for name, shape, spec in zip(entry.names, entry.shapes, entry.specs)])
            for kind in ("model", *MOMENTS)
        }
        pieces[key.group]["step"] = steps[key.group]
    sync.load_pieces(pieces)


def load_verified(state: dict[str, torch.Tensor], manifest: Manifest, no_dist: bool,
                  reader: VerifiedReader | None = None) -> None:
    """DCP load of `state` from the checkpoint's state/ folder, every file checked, tensors only."""
    with _single_process():
        try:
            dcp.load(state, storage_reader=reader or VerifiedReader(manifest), planner=TensorOnlyLoadPlanner(),
                     no_dist=no_dist)
        except dcp.api.CheckpointException as exc:  # DCP gathers every rank's failure: show the first
            first = next(iter(exc.failures.values()), None)
            cause = first[0] if isinstance(first, tuple) else first
            if isinstance(cause, CheckpointError):
                raise cause from None
            raise CheckpointError(f"{manifest.label}: reading its state failed ({cause or exc})") from exc


def restore_sync_state(manifest: Manifest, sync: GradientSync, ranks: PieceRanks) -> None:
    """Same tensor-parallel degree: DCP reads straight into the sync's own tensors (collective under ZeRO)."""
    state = sync.state_dict(ranks, fresh=True)  # buffers of the right shapes, filled in place by DCP
    missing = sorted(set(state) - set(_stored(manifest)))
    if missing:
        raise CheckpointError(f"{manifest.label}: its state lacks {missing[:3]}: it does not match this model")
    load_verified(state, manifest, no_dist=not sync.collective_checkpoint)
    sync.load_state_dict(state, ranks)


def _stored(manifest: Manifest, reader: VerifiedReader | None = None) -> dict:
    return (reader or VerifiedReader(manifest)).read_metadata().state_dict_metadata


def read_steps(manifest: Manifest, layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """AdamW's step count of every group (the same on every TP piece)."""
    keys = {key.group: key.tensor("step") for key in sorted(layout.pieces)}
    state = {name: torch.zeros((), dtype=torch.float32) for name in keys.values()}
    load_verified(state, manifest, no_dist=True)
    return {group: state[name] for group, name in keys.items()}


def read_consolidated(manifest: Manifest, layout: CheckpointLayout,
                      kinds: tuple[str, ...] = ("model",)) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> every parameter whole (fp32), from a checkpoint saved under any layout; one process, no group."""
    reader = VerifiedReader(manifest)
    stored = _stored(manifest, reader)
    missing = sorted({key.tensor(kind) for key in layout.pieces for kind in kinds} - set(stored))
    if missing:
        raise CheckpointError(f"{manifest.label}: its state lacks {missing[:3]} that layout.json lists: damaged")
    flats = {key.tensor(kind): torch.empty(stored[key.tensor(kind)].size, dtype=torch.float32)
             for key in layout.pieces for kind in kinds}
    load_verified(flats, manifest, no_dist=True, reader=reader)
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


def read_consolidated_weights(manifest: Manifest, layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """Every parameter whole, fp32, from a checkpoint saved under any layout; one process, no group."""
    return read_consolidated(manifest, layout)["model"]

