"""The trainer's checkpoints: where the run starts, saving, and rolling back, agreed by every rank.

Rank 0 of the training ranks looks at the output folder and verifies the candidate checkpoints
(train/resume.py), and broadcasts the decision, so every rank resumes from the same checkpoint
(or stops with the same error). Each rank then reads what it needs through the checkpoint's
manifest, which verifies every file it opens. Saving goes through train/checkpoint_writer.py
(synchronous or asynchronous); a rollback of the non-finite guard reloads the newest checkpoint
that verifies, in-process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from fivefold.config import JobConfig
from fivefold.errors import CheckpointError, ConfigError, TrainingFault
from fivefold.model import ModelConfig
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.parallelize import Parallelized
from fivefold.reliability.manifest import Manifest
from fivefold.reliability.supervisor import Supervisor
from fivefold.train import checkpoint as ckpt
from fivefold.train.checkpoint_writer import CheckpointWriter
from fivefold.train.rendezvous import announce
from fivefold.train.resume import apply_resume_settings, plan_rollback, plan_start, remove_run_files, resume_settings
from fivefold.train.train_state import capture_training_state, restore_training_state


class RunCheckpoints:
    """Start, save and roll back one run's checkpoints (every training rank calls each method together)."""

    def __init__(self, config: JobConfig, mesh: Mesh, rank: int, distributed: bool, supervisor: Supervisor,
                 log: Callable[[str], None]):
        self.config, self.mesh, self.supervisor, self.log = config, mesh, supervisor, log
        self.output_dir = Path(config.train.output_dir)
        self.group, self.distributed = mesh.trainer_group(), distributed
        self.is_rank0 = rank == 0
        plan = self._agree(lambda: plan_start(config, self.output_dir, restarted=supervisor.attempt > 0))
        if plan.error:
            raise (ConfigError if plan.error_kind == "config" else CheckpointError)(plan.error)
        for note in plan.notes:
            log(note)
        if self.is_rank0 and plan.remove_earlier:
            remove_run_files(self.output_dir, plan.remove_earlier)
        if self.is_rank0:  # ranks outside the trainers' group (parameter servers) may now write in the folder
            announce("output-ready", supervisor.attempt_id)
        self.plan = plan
        self.manifest: Manifest | None = ckpt.open_checkpoint(Path(plan.resume_from)) if plan.resume_from else None
        self.run_id = self._agree(self._run_id)
        self.writer: CheckpointWriter | None = None

    # ------------------------------------------------------------------ agreement
    def _agree(self, decide: Callable):
        """`decide()` on rank 0, its result on every rank (an exception there becomes every rank's)."""
        box: list = [None]
        if self.is_rank0:
            try:
                box[0] = ("ok", decide())
            except (CheckpointError, ConfigError, OSError) as exc:
                box[0] = ("error", f"{type(exc).__name__}", str(exc))
        if self.distributed:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast_object_list(box, src=src, group=self.group)
        if box[0][0] == "error":
            raise (ConfigError if box[0][1] == "ConfigError" else CheckpointError)(box[0][2])
        return box[0][1]

    def _run_id(self) -> str:
        """This run's id: the resumed checkpoint's when continuing in its own folder, else a new one (run.json)."""
        own = self.manifest.body.get("run_id") if self.manifest is not None and self.plan.continues_run else None
        known = ckpt.read_run_id(self.output_dir) if self.plan.continues_run or self.plan.resume_from is None else None
        return ckpt.write_run_id(self.output_dir, own or known)

    # ------------------------------------------------------------------ start
    @property
    def resumed_from(self) -> Path | None:
        return Path(self.plan.resume_from) if self.plan.resume_from else None

    def saved_state(self) -> ckpt.TrainerState | None:
        return None if self.manifest is None else ckpt.load_trainer_state(self.manifest, restore_rng=False)

    def adjusted_config(self, config: JobConfig, model: ModelConfig, dp: int, data_fingerprint: str) -> JobConfig:
        """The config this run continues with (an elastic resume's grad_accum_steps), after checking it is the same run."""
        if self.manifest is None:
            return config
        settings = resume_settings(ckpt.load_config_dict(self.manifest), self.saved_state(), config,
                                   dataclasses.asdict(model), dp, data_fingerprint)
        for note in settings.changed:
            self.log(f"resumed with a change: {note}")
        return apply_resume_settings(config, settings, str(self.resumed_from))

    def restore(self, parallel: Parallelized) -> ckpt.TrainerState | None:
        """Weights, optimizer states and RNG from the chosen checkpoint (collective under ZeRO)."""
        if self.manifest is None:
            return None
        saved = ckpt.load_layout(self.manifest)
        ckpt.check_layout(self.resumed_from, saved, parallel.layout)
        restore_training_state(self.manifest, parallel, saved)
        return ckpt.load_trainer_state(self.manifest)

    # ------------------------------------------------------------------ save
    def save(self, parallel: Parallelized, state: ckpt.TrainerState, config: dict, tokenizer) -> Path:
        if self.writer is None:
            c, faults = self.config.checkpoint, self.supervisor.faults
            background = self.mesh.private_copy(self.group or _world()) if c.async_save and self.distributed else None
            self.writer = CheckpointWriter(self.output_dir, c.keep_last, self.run_id, self.group, self.distributed,
                                           c.async_save, background, faults.before_write, faults.after_write)
        with self.supervisor.phase(f"checkpoint step {state.step}"):
            return self.writer.save(capture_training_state(parallel), parallel.layout, state, config, tokenizer)

    def wait(self) -> Path | None:
        if self.writer is None:
            return None
        with self.supervisor.phase("waiting for the checkpoint in flight"):
            return self.writer.wait()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ rollback
    def rollback(self, parallel: Parallelized, state: ckpt.TrainerState, step: int, reason: str,
                 first_bad: int) -> ckpt.TrainerState:
        """Reload the newest checkpoint from before step `first_bad` that verifies (collective); counters carry on."""
        if state.rollbacks >= self.config.guard.max_rollbacks:
            raise TrainingFault(f"training stopped at step {step}: {reason} after {state.rollbacks} rollback(s) "
                                "(guard.max_rollbacks)")
        self.wait()
        plan = self._agree(lambda: plan_rollback(self.output_dir, first_bad))
        if plan.error or plan.resume_from is None:
            raise TrainingFault(f"non-finite training at step {step} and no verified checkpoint to roll back to "
                                f"({plan.error or 'none saved yet'}): lower optim.lr, check the data, or save "
                                "checkpoints more often (checkpoint.every)")
        self.manifest = ckpt.open_checkpoint(Path(plan.resume_from))
        parallel.sync.flush()
        saved = ckpt.load_layout(self.manifest)
        restore_training_state(self.manifest, parallel, saved)
        restored = ckpt.load_trainer_state(self.manifest)
        g = self.config.guard
        skip = (step - restored.step) if g.skip_data_on_rollback else 0
        new = dataclasses.replace(restored, skipped_steps=state.skipped_steps, rollbacks=state.rollbacks + 1,
                                  lr_scale=state.lr_scale * g.rollback_lr_factor, data_offset=state.data_offset + skip)
        self.supervisor.guard.forget()
        self.supervisor.events.log("rollback", step=step, to=new.step, reason=reason)
        self.log(f"step {step}: {reason}: rolled back to step {new.step} (rollback {new.rollbacks}; "
                 f"lr x{new.lr_scale:g}; data offset {new.data_offset})")
        return new


def _world():
    return torch.distributed.group.WORLD
