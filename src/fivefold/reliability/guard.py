"""The non-finite guard: skip bad steps, roll back after repeated ones, stop after repeated rollbacks.

Once the gradients of a step are final and before the optimizer touches anything, every rank
contributes two numbers to one all-reduce (sum) over the ranks that train together: a flag, 1 if
its own loss sum or the global gradient norm is not finite, and its share of the loss (its loss
sum divided by the tensor-parallel replicas that hold the same value). So every rank reaches the
same verdict (the flags are OR-ed by the sum) from the same global loss, whatever the layout.

    skip        a bad step updates nothing (the gradients are dropped; weights, optimizer states and
                ZeRO shards stay as they were); the data and the schedule move on; counted as
                `skipped_steps` in metrics.jsonl and trainer.json
    rollback    after `guard.max_bad_steps` (K) bad steps in a row: reload the newest verified
                checkpoint (in-process, collective), optionally scale the learning rate by
                `guard.rollback_lr_factor` and skip the data of the bad window (PaLM's recipe,
                Chowdhery et al. 2022, sec. 5.1: restart before the spike and skip the batches)
    stop        after `guard.max_rollbacks` (R) rollbacks, or with no checkpoint to roll back to:
                a TrainingFault naming the step, non-zero exit (EXIT_FAULT)

Loss-spike detection (`guard.spike_zscore` > 0, off by default) uses the same path: a step whose
loss lies more than z standard deviations above the mean of the last `guard.spike_window` good
steps is a bad step. Asynchronous parameter-server workers judge their own steps; a scheme that
cannot withhold an update (parameter-server runs, whose servers apply pushes) stops at the first
bad step instead of skipping.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from fivefold.reliability.activity import phase


class Action(Enum):
    CONTINUE = "continue"
    ROLLBACK = "rollback"
    STOP = "stop"


@dataclass(frozen=True)
class Check:
    """The verdict on one step, the same on every rank."""

    bad: bool
    reason: str  # "" when good
    loss: float  # the step's global loss (sum over tokens / tokens)


class NonFiniteGuard:
    """Judges each step from (local loss sum, global grad norm); counts bad steps and rollbacks."""

    def __init__(self, max_bad_steps: int, max_rollbacks: int, spike_zscore: float, spike_window: int,
                 group: dist.ProcessGroup | None, distributed: bool, replicas: int = 1, enabled: bool = True):
        self.max_bad_steps, self.max_rollbacks = max_bad_steps, max_rollbacks
        self.spike_zscore, self.enabled = spike_zscore, enabled
        self.group, self.distributed, self.replicas = group, distributed, replicas
        self.recent: deque[float] = deque(maxlen=spike_window)
        self.consecutive = 0

    def check(self, local_loss_sum: torch.Tensor | float, grad_norm: float | None, total_tokens: int) -> Check:
        """Collective over the group: every rank gets the same verdict."""
        local = float(local_loss_sum)
        flags = torch.tensor([0.0 if math.isfinite(local) else 1.0,
                              local / self.replicas if math.isfinite(local) else 0.0,
                              0.0 if grad_norm is None or math.isfinite(grad_norm) else 1.0], dtype=torch.float64)
        if self.distributed:
            with phase("guard all-reduce", comm=True):
                dist.all_reduce(flags, group=self.group)
        loss = float(flags[1]) / max(total_tokens, 1)
        if flags[0] > 0:
            return Check(True, "non-finite loss", float("nan"))
        if flags[2] > 0:
            return Check(True, "non-finite gradient norm", loss)
        z = self.zscore(loss)
        if z is not None and z > self.spike_zscore:
            return Check(True, f"loss spike (z = {z:.1f} > guard.spike_zscore = {self.spike_zscore:g})", loss)
        return Check(False, "", loss)

    def zscore(self, loss: float) -> float | None:
        """How many standard deviations `loss` lies above the recent good losses (None: detection off or too few)."""
        if self.spike_zscore <= 0 or len(self.recent) < min(10, self.recent.maxlen or 10):
            return None
        mean = sum(self.recent) / len(self.recent)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / len(self.recent))
        return (loss - mean) / max(std, 1e-6 * abs(mean), 1e-12)

    def after_step(self, check: Check, rollbacks_so_far: int, can_skip: bool) -> Action:
        """What the loop does next, given this step's verdict."""
        if not check.bad:
            self.consecutive = 0
            self.recent.append(check.loss)
            return Action.CONTINUE
        self.consecutive += 1
        if not can_skip:
            return Action.STOP
        if self.consecutive < self.max_bad_steps:
            return Action.CONTINUE
        self.consecutive = 0
        return Action.STOP if rollbacks_so_far >= self.max_rollbacks else Action.ROLLBACK

    def forget(self) -> None:
        """After a rollback: the losses before it no longer describe the run."""
        self.recent.clear()
        self.consecutive = 0


def states_finite(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, distributed: bool) -> bool:
    """Whether every tensor of every rank is finite (collective): checked before a checkpoint is written."""
    bad = torch.zeros((), dtype=torch.float64)
    for tensor in tensors:
        if tensor is not None and tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
            bad += 1
            break
    if distributed:
        with phase("finiteness all-reduce before saving", comm=True):
            dist.all_reduce(bad, group=group)
    return bool(bad == 0)
