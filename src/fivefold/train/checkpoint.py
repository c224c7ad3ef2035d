"""Atomic, reshardable checkpoints with exact resume.

A checkpoint is a folder `step-NNNNNN` holding
    state/                weights and AdamW state through torch.distributed.checkpoint (DCP):
                          `.metadata` plus one `__<rank>_0.distcp` file per writing rank
                          (keys and layout: train/train_state.py)
    layout.json           which parameters each flat group holds, so weights load without the model
    rng.pt                torch CPU/CUDA generator states (loaded with weights_only=True)
    trainer.json          step, tokens seen, sampler seed
    config.json           the resolved run configuration
    tokenizer.*           the tokenizer, so generation needs nothing else
    meta.json             written last: format version and the file list
Every rank writes its own part of `state/` in parallel (under ZeRO, only its shards); rank 0
writes the rest. All of it goes under a temporary name that rank 0 renames into place once
every rank has finished, so a crash leaves either the old set of checkpoints or the new one,
never a half-written `step-*` folder. The data sampler and LR schedule are pure functions of
the step, so (step, weights, optimizer, RNG) is the whole training state. With several nodes,
`train.output_dir` must be on a filesystem every node sees.

Tensors are read back with `weights_only=True`; DCP's own `.metadata` index is a pickle that
torch writes and reads, so load checkpoints only from sources you trust (or convert them to
safetensors with `fivefold convert`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fivefold.errors import CheckpointError
from fivefold.parallel.checkpoint_layout import CheckpointLayout, local_layout
from fivefold.train.train_state import read_consolidated_weights, write_training_state

FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    step: int
    tokens_seen: int
    seed: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_dir():
            _fsync_tree(path)
            continue
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_folder(output_dir: Path, step: int) -> Path:
    """Where a checkpoint is assembled before the rename (the same name on every rank)."""
    return output_dir / f".tmp-{checkpoint_name(step)}"


def _start_checkpoint(output_dir: Path, step: int) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(output_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def save_checkpoint(
    output_dir: Path,
    training_state: dict[str, torch.Tensor],
    layout: CheckpointLayout,
    state: TrainerState,
    config: dict[str, Any],
    tokenizer,
    keep_last: int,
    group: dist.ProcessGroup | None = None,
    distributed: bool | None = None,
) -> Path:
    """Write `output_dir/step-NNNNNN` atomically, then delete all but the newest `keep_last`.

    In a distributed run every rank of `group` (default: all) must call this with its part of
    `training_state` (train_state.capture_training_state); DCP writes the parts in parallel.
    `distributed=False` writes from this process alone.
    """
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    coordinator = not distributed or dist.get_rank() == 0
    final = output_dir / checkpoint_name(state.step)
    tmp = temporary_folder(output_dir, state.step)
    if coordinator:
        _start_checkpoint(output_dir, state.step)
    if distributed:
        dist.barrier(group=group)
    write_training_state(training_state, tmp / "state", distributed, group)
    if distributed:
        dist.barrier(group=group)  # every rank's shard is on disk
    if coordinator:
        (tmp / "layout.json").write_text(json.dumps(layout.to_json(), indent=1))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        torch.save(rng, tmp / "rng.pt")
        (tmp / "trainer.json").write_text(json.dumps(state.__dict__, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT_VERSION, "step": state.step, "files": files}))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune_checkpoints(output_dir, keep_last)
    if distributed:
        dist.barrier(group=group)  # nobody reads the checkpoint list before the rename
    return final


def is_complete(folder: Path) -> bool:
    meta = folder / "meta.json"
    if not meta.is_file():
        return False
    try:
        meta_data = json.loads(meta.read_text())
        files = meta_data["files"]
    except (ValueError, KeyError):
        return False
    return all((folder / name).is_file() for name in files)


def check_format(folder: Path) -> None:
    found = json.loads((folder / "meta.json").read_text()).get("format")
    if found != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {folder} has format {found}; this fivefold reads format {FORMAT_VERSION} "
            "(sharded torch.distributed.checkpoint state); retrain or convert it with the fivefold that wrote it"
        )


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def prune_checkpoints(output_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and leftovers of interrupted saves."""
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in output_dir.glob(".tmp-step-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """`none` -> None; `auto` -> newest complete checkpoint or None; else that folder, which must be complete."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    folder = Path(resume)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint.resume = {resume!r}: no such folder; use auto, none or a step-* folder")
    if not is_complete(folder):
        raise CheckpointError(f"checkpoint {folder} is incomplete (no meta.json or missing files); pick another one")
    return folder


def load_config_dict(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a fivefold checkpoint (no config.json)")
    return json.loads(path.read_text())


def load_layout(folder: Path) -> CheckpointLayout:
    path = Path(folder) / "layout.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no layout.json: not a complete fivefold checkpoint")
    check_format(Path(folder))
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}): the checkpoint is damaged") from exc
    return CheckpointLayout.from_json(data)


def check_layout(folder: Path, saved: CheckpointLayout, expected: CheckpointLayout) -> None:
    """Refuse a checkpoint whose whole parameters (names, unsplit shapes) differ from this run's model.

    Any tensor-parallel or pipeline degree can be read (train_state.restore_training_state reshards);
    only a different model cannot. The message names both layouts.
    """
    saved_shapes, model_shapes = saved.full_shapes(), expected.full_shapes()
    if saved_shapes == model_shapes:
        return
    missing = sorted(set(model_shapes) - set(saved_shapes))
    unexpected = sorted(set(saved_shapes) - set(model_shapes))
    shapes = sorted(n for n in set(saved_shapes) & set(model_shapes) if saved_shapes[n] != model_shapes[n])
    raise CheckpointError(
        f"checkpoint {folder} ({saved.describe()}) does not match this run's model ({expected.describe()}): "
        f"missing {missing[:5]}, unexpected {unexpected[:5]}, "
        f"different shapes {[(n, saved_shapes[n], model_shapes[n]) for n in shapes[:3]]}; "
        "the model config differs from the one it was saved with"
    )


def load_model_weights(folder: Path, model: nn.Module) -> None:
    """Consolidated weights into a whole model, from a checkpoint saved under any layout (TP pieces joined)."""
    layout = load_layout(folder)
    check_layout(folder, layout, local_layout(model, None))
    model.load_state_dict(read_consolidated_weights(Path(folder), layout), strict=False)


def load_trainer_state(folder: Path) -> TrainerState:
    """Restore the RNG and return the trainer state (weights and optimizer: train_state.restore_training_state)."""
    rng = torch.load(folder / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    return TrainerState(**json.loads((folder / "trainer.json").read_text()))
