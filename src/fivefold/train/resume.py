"""Where a run starts and whether its output folder may be used: the decisions, free of any process group.

`checkpoint.resume`:
    none   a fresh run. A train.output_dir that holds another run (step-* checkpoints, metrics.jsonl,
           run.json) is refused, unless `checkpoint.overwrite = true`, which first removes fivefold's
           files of that run (checkpoints, metrics, plots, TensorBoard events, event logs, heartbeats)
           and leaves any other file alone
    auto   the newest checkpoint of train.output_dir whose every file verifies against its manifest;
           damaged ones are skipped, each with the reason; with none at all the run starts fresh and
           says so; with only damaged ones it stops, listing each (nothing is overwritten)
    DIR    that checkpoint, verified; saved into another train.output_dir it starts a new run there
A restarted attempt (`--max-restarts`) always resumes `auto`.

Resuming must continue the same run (`resume_settings`): other model settings are refused; so are
settings that change which data a step sees (train.seed, train.seq_len, the global batch =
micro_batch_size x grad_accum_steps x dp, the [data] settings and the training tokens themselves),
unless `checkpoint.allow_changes = true`. A different data-parallel degree is an elastic resume:
grad_accum_steps is recomputed so the global batch stays what it was (4 -> 3 -> 2 ranks with a
global batch of 12: accumulation 3 -> 4 -> 6), and the sampler, which draws each step's global batch
from (seed, step) alone, hands the same samples to the new ranks. Any other changed setting is
listed. A checkpoint at the last step means the run is complete.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fivefold.config import JobConfig
from fivefold.errors import CheckpointError, ConfigError
from fivefold.train.checkpoint import (
    STEP_DIR,
    TrainerState,
    list_checkpoints,
    remove_incomplete,
    step_of,
    verify_checkpoint,
)

RUN_FILES = ("metrics.jsonl", "loss.png", "run.json", "failure.json", "pipeline_trace.json", "pipeline_trace.png")
RUN_FOLDERS = ("tensorboard", "events", "heartbeats")
DATA_SETTINGS = ("train.seed", "train.seq_len", "data.source", "data.tokenizer", "data.bpe_vocab_size",
                 "data.val_fraction", "data.jsonl_field")
NOT_COMPARED = ("checkpoint.resume", "checkpoint.overwrite", "checkpoint.allow_changes", "train.output_dir")


@dataclass
class StartPlan:
    """Rank 0's decision, shared with every rank: resume from a folder, or start fresh."""

    resume_from: str | None = None
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # a CheckpointError or ConfigError message every rank raises
    error_kind: str = "checkpoint"
    remove_earlier: list[str] = field(default_factory=list)  # an earlier run's files to delete (overwrite)
    continues_run: bool = False  # the checkpoint belongs to this output folder's run


def earlier_run(output_dir: Path) -> list[str]:
    """The results of a run in `output_dir` that a fresh run would lose: step-* folders and metrics.

    Diagnostics alone (events, heartbeats, failure.json, run.json of a run that died before its first
    checkpoint or metric) are not results; a fresh run clears them without asking.
    """
    if not output_dir.is_dir():
        return []
    found = sorted(p.name for p in output_dir.iterdir() if STEP_DIR.match(p.name))
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def plan_rollback(output_dir: Path, before_step: int) -> StartPlan:
    """The newest checkpoint before step `before_step` whose every file verifies (the guard's rollback target)."""
    return _plan_auto(output_dir, before_step)


def plan_start(config: JobConfig, output_dir: Path, restarted: bool = False) -> StartPlan:
    """Decide where the run starts (reads and verifies files; no process group)."""
    c = config.checkpoint
    if output_dir.exists() and not output_dir.is_dir():
        return StartPlan(error=f"train.output_dir = {output_dir} is a file: name a folder", error_kind="config")
    resume = "auto" if restarted else c.resume
    if resume == "none":
        found = earlier_run(output_dir)
        if found and not c.overwrite:
            return StartPlan(error_kind="config", error=(
                f"train.output_dir = {output_dir} holds another run ({', '.join(found[:4])}{' ...' if len(found) > 4 else ''}): "
                "continue it with --resume auto, choose a new train.output_dir, or pass --overwrite "
                "(checkpoint.overwrite = true) to replace it"))
        return StartPlan(remove_earlier=_run_files(output_dir) if output_dir.is_dir() else [],
                         notes=[f"--overwrite: removing the earlier run in {output_dir}"] if found else [])
    if resume == "auto":
        return _plan_auto(output_dir)
    folder = Path(resume)
    try:
        verify_checkpoint(folder)
    except CheckpointError as exc:
        return StartPlan(error=str(exc))
    inside = folder.resolve().parent == output_dir.resolve()
    found = [] if inside else earlier_run(output_dir)
    if found and not c.overwrite:
        return StartPlan(error_kind="config", error=(
            f"resuming from {folder} into train.output_dir = {output_dir}, which holds another run ({', '.join(found[:4])}): "
            "choose a new train.output_dir or pass --overwrite"))
    return StartPlan(str(folder), [f"resuming from {folder} (verified)"], remove_earlier=_run_files(output_dir) if found else [],
                     continues_run=inside)


def _plan_auto(output_dir: Path, before_step: int | None = None) -> StartPlan:
    candidates = [c for c in reversed(list_checkpoints(output_dir)) if before_step is None or step_of(c) < before_step]
    if not candidates:
        note = f"--resume auto: no checkpoint in {output_dir}: starting fresh"
        if (output_dir / "metrics.jsonl").is_file():
            note += " (metrics.jsonl keeps the earlier attempt's records; the restart is marked in it)"
        return StartPlan(notes=[note])
    skipped = []
    for folder in candidates:
        try:
            manifest = verify_checkpoint(folder)
        except CheckpointError as exc:
            skipped.append(f"skipping {folder.name}: {exc}")
            continue
        gigabytes = sum(e["bytes"] for e in manifest.files.values()) / 1e9
        return StartPlan(str(folder), [*skipped, f"resuming from {folder} (step {step_of(folder)}, "
                                                 f"{len(manifest.files)} files, {gigabytes:.3f} GB verified)"],
                         continues_run=True)
    return StartPlan(error="\n".join([f"--resume auto: no usable checkpoint in {output_dir}:", *skipped,
                                      f"check them with `fivefold verify {output_dir}`; to start over instead, "
                                      "pass --resume none --overwrite"]))


def _run_files(output_dir: Path) -> list[str]:
    names = [p.name for p in output_dir.iterdir() if STEP_DIR.match(p.name) or p.name.startswith((".tmp-step-", ".old-step-"))]
    names += [n for n in (*RUN_FILES, *RUN_FOLDERS) if (output_dir / n).exists()]
    return sorted(names)


def remove_run_files(output_dir: Path, names: list[str]) -> None:
    """Delete an earlier run's files (the names `plan_start` listed) and leftovers of interrupted saves."""
    for name in names:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    remove_incomplete(output_dir)


# ------------------------------------------------------------------------------ same run?
def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


@dataclass
class ResumeSettings:
    grad_accum_steps: int
    refused: list[str]  # changed settings that alter the run (refused unless checkpoint.allow_changes)
    changed: list[str]  # other changed settings, listed for the user


def resume_settings(saved_config: dict[str, Any], saved: TrainerState, config: JobConfig, model: dict[str, Any],
                    dp: int, data_fingerprint: str) -> ResumeSettings:
    """Compare the checkpoint's run with this one; the grad_accum_steps that keeps its global batch."""
    before, now = _flat(saved_config), _flat({**config.to_dict(), "model": model})
    model_diffs = [k for k in now if k.startswith("model.") and k not in ("model.name", "model.init_from_hf")
                   and k in before and before[k] != now[k]]
    if model_diffs:
        raise CheckpointError(
            f"the checkpoint was trained with different model settings ({', '.join(model_diffs)}); "
            "resume with the same model config or start a new train.output_dir")
    if saved.step == 0:  # nothing trained yet (e.g. `fivefold convert --from-hf`): any data and batch may follow
        return ResumeSettings(config.train.grad_accum_steps, [], [])
    refused = [f"{k}: {before[k]!r} -> {now[k]!r}" for k in DATA_SETTINGS if k in before and before[k] != now[k]]
    if saved.data_fingerprint and saved.data_fingerprint != data_fingerprint:
        refused.append(f"the training tokens (fingerprint {saved.data_fingerprint} -> {data_fingerprint}): the corpus "
                       "or its tokenization changed")
    t = config.train
    accum = t.grad_accum_steps
    global_batch = saved.global_batch or before.get("train.micro_batch_size", 0) * before.get("train.grad_accum_steps", 0)
    configured = saved.grad_accum_configured or before.get("train.grad_accum_steps")
    changed = []
    if global_batch and t.micro_batch_size * accum * dp != global_batch:
        if accum == configured and global_batch % (t.micro_batch_size * dp) == 0:  # the user's setting, as before
            accum = global_batch // (t.micro_batch_size * dp)
            changed.append(f"elastic resume: data-parallel ranks {saved.data_parallel} -> {dp}, train.grad_accum_steps "
                           f"{t.grad_accum_steps} -> {accum} keeps the global batch of {global_batch} samples")
        else:
            refused.append(f"the global batch (micro_batch_size x grad_accum_steps x dp): {global_batch} -> "
                           f"{t.micro_batch_size * accum * dp} ({t.micro_batch_size} x {accum} x {dp})"
                           + ("; with another dp, keep grad_accum_steps as saved and let it be recomputed, or choose a "
                              f"micro_batch_size that divides {global_batch // dp if global_batch % dp == 0 else global_batch}"
                              if dp != saved.data_parallel else ""))
    for key in sorted(set(now) & set(before)):
        if key.startswith("model.") or key in DATA_SETTINGS or key in NOT_COMPARED or key.startswith("fault."):
            continue
        if key == "train.grad_accum_steps" and now[key] == configured:
            continue  # the recomputed value was saved; the user's own is unchanged
        if before[key] != now[key]:
            changed.append(f"{key}: {before[key]!r} -> {now[key]!r}")
    return ResumeSettings(accum, refused, changed)


def apply_resume_settings(config: JobConfig, settings: ResumeSettings, folder: str) -> JobConfig:
    """The config to run with, or a CheckpointError listing what changes the run (unless allowed)."""
    if settings.refused and not config.checkpoint.allow_changes:
        raise ConfigError(
            f"resuming from {folder} with settings that change which data each step sees: "
            f"{'; '.join(settings.refused)}. Restore them, or pass --checkpoint.allow_changes true to resume anyway")
    if settings.grad_accum_steps == config.train.grad_accum_steps:
        return config
    out = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_accum_steps=settings.grad_accum_steps))
    try:
        return out.validate()
    except ConfigError as exc:
        raise CheckpointError(f"an elastic resume needs train.grad_accum_steps = {settings.grad_accum_steps}, "
                              f"which this layout cannot run: {exc}") from exc
