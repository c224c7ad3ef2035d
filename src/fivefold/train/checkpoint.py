"""Checkpoint folders: naming, the verified manifest, what they hold, and which of them to keep.

    <output_dir>/
      run.json                  this run's identity (run_id): checkpoints of another run are never pruned
      step-000200/              one checkpoint, renamed into place only when complete
        state/                  weights and AdamW states through torch.distributed.checkpoint (DCP)
        layout.json             each flat group's parameter names, shapes and tensor-parallel split
        trainer.json            step, tokens seen, seed, the global batch and the guard's counters
        rng.pt                  RNG states (torch.load with weights_only=True)
        config.json             the resolved config
        tokenizer.json | tokenizer.txt
        meta.json               the manifest, written last: every file's size and hash (reliability/manifest.py)

Every file is read through the manifest, so a damaged file fails with a CheckpointError naming it
and the step (never read as garbage), and DCP's own index is read without unpickling arbitrary
objects (reliability/safe_dcp.py). Saving lives in train/checkpoint_writer.py, the choice of where
to resume in train/resume.py.

Retention: `checkpoint.keep_last` keeps the most recently *written* checkpoints of this run (by
the time in their manifest, not by step number), so a checkpoint written after a rollback is never
pruned in favour of older, higher-numbered ones. Folders of interrupted saves are removed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fivefold.errors import CheckpointError
from fivefold.model.moe import load_expert_biases
from fivefold.parallel.checkpoint_layout import KINDS, CheckpointLayout, local_layout
from fivefold.reliability.manifest import Manifest
from fivefold.reliability.safe_dcp import VerifiedReader
from fivefold.train.train_state import read_consolidated_weights

FORMAT_VERSION = 3
STEP_DIR = re.compile(r"^step-(\d+)$")
RUN_FILE = "run.json"


@dataclass
class TrainerState:
    """Everything of the loop's state that is not a tensor (trainer.json)."""

    step: int
    tokens_seen: int
    seed: int
    global_batch: int = 0  # samples per optimizer step: micro_batch x grad_accum x dp
    data_parallel: int = 1  # dp when saved (an elastic resume keeps global_batch at another dp)
    grad_accum_configured: int = 0  # train.grad_accum_steps as the user set it (before elastic recomputation)
    data_fingerprint: str = ""  # checksum of the training token file
    skipped_steps: int = 0  # steps the non-finite guard skipped
    rollbacks: int = 0  # times the guard rolled back to a checkpoint
    lr_scale: float = 1.0  # learning-rate factor after rollbacks
    data_offset: int = 0  # steps of data skipped after rollbacks (the sampler reads step + data_offset)
    expert_bias: dict = dataclasses.field(default_factory=dict)  # MoE layer -> auxiliary-loss-free balancing bias

    @classmethod
    def from_json(cls, data: dict, source: str) -> "TrainerState":
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        try:
            values = {k: v for k, v in data.items() if k in known}
            state = cls(**values)
            for name in ("step", "tokens_seen", "seed", "global_batch", "data_parallel", "grad_accum_configured",
                         "skipped_steps", "rollbacks", "data_offset"):
                if not isinstance(getattr(state, name), int) or getattr(state, name) < 0:
                    raise ValueError(f"{name} = {getattr(state, name)!r}")
            bias = state.expert_bias
            if not isinstance(bias, dict) or not all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
                                                     for v in bias.values()):
                raise ValueError(f"expert_bias = {bias!r}")
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: trainer.json holds an invalid trainer state ({exc})") from exc
        return state


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(folder: Path) -> int | None:
    match = STEP_DIR.match(Path(folder).name)
    return int(match.group(1)) if match else None


def temporary_folder(output_dir: Path, step: int) -> Path:
    """Where a checkpoint is assembled before the rename (the same name on every rank)."""
    return output_dir / f".tmp-{checkpoint_name(step)}"


# ------------------------------------------------------------------------------------ reading
def open_checkpoint(folder: Path) -> Manifest:
    """The verified manifest of a checkpoint folder (checks its format); every later read goes through it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder}: no such folder; give a step-* folder or a run folder")
    label = f"checkpoint {folder}"
    manifest = Manifest.load(folder, "meta.json", label)
    found = manifest.body.get("format")
    if found != FORMAT_VERSION:
        raise CheckpointError(
            f"{label} has format {found}; this fivefold reads format {FORMAT_VERSION} (checksummed manifest); "
            "earlier formats carry no checksums: load it with the fivefold that wrote it and export it "
            "(`fivefold convert`), or retrain"
        )
    manifest.label = f"checkpoint {folder} (step {manifest.body.get('step')})"
    return manifest


def load_config_dict(folder: Path | Manifest) -> dict[str, Any]:
    manifest = folder if isinstance(folder, Manifest) else open_checkpoint(folder)
    data = manifest.read_json("config.json")
    if not isinstance(data, dict):
        raise CheckpointError(f"{manifest.label}: config.json does not hold a config table")
    return data


def load_layout(folder: Path | Manifest) -> CheckpointLayout:
    manifest = folder if isinstance(folder, Manifest) else open_checkpoint(folder)
    try:
        return CheckpointLayout.from_json(manifest.read_json("layout.json"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{manifest.label}: layout.json does not describe a layout ({exc})") from exc


def load_trainer_state(folder: Path | Manifest, restore_rng: bool = True) -> TrainerState:
    """The trainer state; restores the RNG states too (weights and optimizer: train_state.restore_training_state)."""
    manifest = folder if isinstance(folder, Manifest) else open_checkpoint(folder)
    state = TrainerState.from_json(manifest.read_json("trainer.json"), manifest.label)
    if restore_rng:
        try:
            rng = torch.load(io.BytesIO(manifest.read_bytes("rng.pt")), weights_only=True)
            torch.set_rng_state(rng["cpu"])
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - weights_only refuses anything but tensors: damaged
            raise CheckpointError(f"{manifest.label}: rng.pt is not a readable RNG state ({exc})") from exc
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(rng["cuda"]))
    return state


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
    manifest = open_checkpoint(folder)
    layout = load_layout(manifest)
    check_layout(folder, layout, local_layout(model))
    model.load_state_dict(read_consolidated_weights(manifest, layout), strict=False)
    load_expert_biases(model.modules(), load_trainer_state(manifest, restore_rng=False).expert_bias)


def verify_checkpoint(folder: Path) -> Manifest:
    """Every file against the manifest, and every part parsed (the offline check of `fivefold verify`)."""
    manifest = open_checkpoint(folder)
    manifest.verify_all()
    load_config_dict(manifest)
    layout = load_layout(manifest)
    TrainerState.from_json(manifest.read_json("trainer.json"), manifest.label)
    try:
        rng = torch.load(io.BytesIO(manifest.read_bytes("rng.pt")), weights_only=True)
        if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
            raise ValueError("no cpu RNG state")
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - weights_only refuses anything but tensors
        raise CheckpointError(f"{manifest.label}: rng.pt is not a readable RNG state ({exc})") from exc
    stored = VerifiedReader(manifest).read_metadata().state_dict_metadata
    missing = sorted(key.tensor(kind) for key in layout.pieces for kind in KINDS
                     if key.tensor(kind) not in stored)
    if missing:
        raise CheckpointError(f"{manifest.label}: its state lacks {missing[:3]} that layout.json lists")
    return manifest


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter whole (fp32) of a checkpoint saved under any layout; one process."""
    manifest = open_checkpoint(folder)
    return read_consolidated_weights(manifest, load_layout(manifest))


def load_checkpoint_tokenizer(folder: Path | Manifest):
    """The tokenizer saved in a checkpoint, once its file verifies against the manifest."""
    from fivefold.data.tokenizer import HF_TOKENIZER_FILES, load_tokenizer_from

    manifest = folder if isinstance(folder, Manifest) else open_checkpoint(folder)
    for name in (*HF_TOKENIZER_FILES, "tokenizer.txt"):
        if name in manifest.files:
            manifest.verify(name)
    return load_tokenizer_from(manifest.folder)


def checkpoint_folder(path: Path) -> Path:
    """A step-* folder as given, or the newest complete checkpoint of a run folder."""
    path = Path(path)
    if (path / "meta.json").is_file() or step_of(path) is not None:
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path} holds no complete checkpoint (no step-* folder with a meta.json)")
    return found


# ------------------------------------------------------------------------------------ listing
def is_complete(folder: Path) -> bool:
    """Renamed into place with its manifest (not verified: see `open_checkpoint` and `Manifest.verify_all`)."""
    return (Path(folder) / "meta.json").is_file()


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, by step, oldest first."""
    if not Path(output_dir).is_dir():
        return []
    found = [(step_of(p), p) for p in Path(output_dir).iterdir() if step_of(p) is not None and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def manifest_summary(folder: Path) -> dict[str, Any]:
    """run_id and written_at from a manifest without verifying it (for pruning); {} if unreadable."""
    try:
        body = json.loads((Path(folder) / "meta.json").read_text())
        return {"run_id": body.get("run_id"), "written_at": float(body.get("written_at", 0.0))}
    except (OSError, ValueError, TypeError):
        return {}


def remove_incomplete(output_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves: `.tmp-step-*` folders and step folders without a manifest."""
    removed = []
    if not Path(output_dir).is_dir():
        return removed
    for path in Path(output_dir).iterdir():
        leftover = path.name.startswith(".tmp-step-") or path.name.startswith(".old-step-")
        if path.is_dir() and (leftover or (step_of(path) is not None and not is_complete(path))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def prune_checkpoints(output_dir: Path, keep_last: int, run_id: str) -> list[Path]:
    """Keep the `keep_last` most recently written checkpoints of run `run_id`; never touch another run's."""
    ours = []
    for folder in list_checkpoints(output_dir):
        summary = manifest_summary(folder)
        if summary.get("run_id") == run_id:
            ours.append((summary["written_at"], step_of(folder), folder))
    removed = [folder for _, _, folder in sorted(ours)[:-keep_last]]
    for folder in removed:
        shutil.rmtree(folder)
    remove_incomplete(output_dir)
    return removed


# ------------------------------------------------------------------------------------ run identity
def read_run_id(output_dir: Path) -> str | None:
    path = Path(output_dir) / RUN_FILE
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_run_id(output_dir: Path, run_id: str | None = None) -> str:
    run_id = run_id or uuid.uuid4().hex
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(output_dir) / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}))
    tmp.replace(Path(output_dir) / RUN_FILE)
    return run_id
