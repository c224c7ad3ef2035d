"""Atomic, pickle-free checkpoints with exact resume.

A checkpoint is a folder `step-NNNNNN` holding
    model.safetensors     weights
    optimizer.pt          AdamW state (tensors and numbers only; loaded with weights_only=True)
    rng.pt                torch CPU/CUDA generator states (weights_only)
    trainer.json          step, tokens seen, sampler seed
    config.json           the resolved run configuration
    tokenizer.*           the tokenizer, so generation needs nothing else
    meta.json             written last: format version and the file list
It is written under a temporary name and renamed into place, so a crash leaves either the
old set of checkpoints or the new one, never a half-written `step-*` folder. The data
sampler and LR schedule are pure functions of the step, so (step, weights, optimizer, RNG)
is the whole training state.
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
from safetensors.torch import load_file, save_file
from torch import nn

from fivefold.errors import CheckpointError

FORMAT_VERSION = 1
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
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_file(shard: int | None) -> str:
    """`optimizer.pt`, or `optimizer-shard003.pt` for rank 3's ZeRO shard of the optimizer state."""
    return "optimizer.pt" if shard is None else f"optimizer-shard{shard:03d}.pt"


def temporary_folder(output_dir: Path, step: int) -> Path:
    """Where a checkpoint is assembled before the rename (the same name on every rank)."""
    return output_dir / f".tmp-{checkpoint_name(step)}"


def write_optimizer_shard(output_dir: Path, step: int, optimizer: torch.optim.Optimizer, shard: int) -> None:
    """ZeRO: each rank writes its own optimizer shard into the temporary folder rank 0 created."""
    torch.save(optimizer.state_dict(), temporary_folder(output_dir, step) / optimizer_file(shard))


def start_checkpoint(output_dir: Path, step: int) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(output_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def save_checkpoint(
    output_dir: Path,
    weights: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    state: TrainerState,
    config: dict[str, Any],
    tokenizer,
    keep_last: int,
    started: bool = False,
) -> Path:
    """Write `output_dir/step-NNNNNN` atomically, then delete all but the newest `keep_last`.

    With `started`, the temporary folder already exists and holds the ranks' optimizer shards
    (ZeRO); otherwise the (whole) optimizer state is written here.
    """
    final = output_dir / checkpoint_name(state.step)
    tmp = temporary_folder(output_dir, state.step) if started else start_checkpoint(output_dir, state.step)
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "fivefold", "step": str(state.step)})
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / optimizer_file(None))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    torch.save(rng, tmp / "rng.pt")
    (tmp / "trainer.json").write_text(json.dumps(state.__dict__, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save(tmp)
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / "meta.json").write_text(json.dumps({"format": FORMAT_VERSION, "step": state.step, "files": files}))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune_checkpoints(output_dir, keep_last)
    return final


def is_complete(folder: Path) -> bool:
    meta = folder / "meta.json"
    if not meta.is_file():
        return False
    try:
        files = json.loads(meta.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((folder / name).is_file() for name in files)


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


def load_model_weights(folder: Path, model: nn.Module) -> None:
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no model.safetensors")
    weights = load_file(str(path))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "the model config differs from the one it was saved with"
        )
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"checkpoint {folder}: {name} has shape {tuple(tensor.shape)}, model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=True)


def load_training_state(folder: Path, optimizer: torch.optim.Optimizer, shard: int | None = None) -> TrainerState:
    """Restore the optimizer (whole, or this rank's ZeRO shard) and RNG; return the trainer state."""
    path = folder / optimizer_file(shard)
    if not path.is_file():
        raise CheckpointError(
            f"{folder} has no {path.name}: it was saved with another ZeRO shard count (or without ZeRO); "
            "resume with the same parallel.dp_shard and parallel.zero_stage"
        )
    optimizer.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
    rng = torch.load(folder / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    return TrainerState(**json.loads((folder / "trainer.json").read_text()))
