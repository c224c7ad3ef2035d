"""Fault handling for one rank, as one component the training loop calls at fixed points.

The loop never checks for faults itself (torchft's Manager and NVIDIA's resiliency extension have
the same shape); it calls:

    begin_step(step)               the phase and step heartbeats report; injected step faults fire
    loss_factor(step)              an injected NaN or spike, applied to the loss before backward
    check_update(loss, norm, T)    the non-finite guard's collective verdict (reliability/guard.py)
    after_step(check, ...)         continue, roll back or stop
    phase(name, comm)              what the rank is doing (reliability/activity.py)
    finish(state) / failed(exc)    the last heartbeat, events and the failure verdict

and owns the heartbeat thread (reliability/heartbeat.py), the launcher lifeline, the fault
injector and the event log. A watchdog verdict ends the process from the heartbeat thread, since
the training thread is the one that is stuck.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

import torch.distributed as dist

from fivefold.config import JobConfig
from fivefold.errors import EXIT_FAULT, EXIT_LAUNCHER_DIED, CheckpointError, ConfigError, DataError, TrainingFault
from fivefold.reliability import activity, lifeline
from fivefold.reliability.events import EventLog, write_failure
from fivefold.reliability.faults import FaultInjector, restart_attempt
from fivefold.reliability.guard import Action, Check, NonFiniteGuard
from fivefold.reliability.heartbeat import Heartbeat, Verdict, print_verdict


def shared_attempt_id(distributed: bool, group: dist.ProcessGroup | None = None) -> str:
    """The same on every rank of one attempt, different for the next: torchrun's run id and restart count,
    else an id rank 0 draws and broadcasts (collective over `group`), or a fresh one in a lone process."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"{os.environ['TORCHELASTIC_RUN_ID']}-{restart_attempt()}"
    box = [uuid.uuid4().hex]
    if distributed:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def classify(exc: BaseException) -> str:
    """The failure class of an exception that ends a rank (the names `fivefold diagnose` uses)."""
    text = f"{type(exc).__name__}: {exc} {exc.__cause__ or ''}"
    if isinstance(exc, (MemoryError,)) or "OutOfMemoryError" in text or "out of memory" in text.lower():
        return "out_of_memory"
    if "No space left on device" in text or getattr(exc, "errno", None) == 28:
        return "disk_full"
    if isinstance(exc, TrainingFault):
        return "non_finite"
    if isinstance(exc, CheckpointError):
        return "checkpoint_corrupt"
    if isinstance(exc, DataError):
        return "data_error"
    if isinstance(exc, ConfigError):
        return "config_error"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "collective_timeout"
    if any(word in text for word in ("Connection closed by peer", "Connection reset", "Broken pipe", "ECONNRESET")):
        return "peer_failed"
    return "exception"


class Supervisor:
    """One rank's fault handling: heartbeat and watchdog, guard, fault injection, events."""

    def __init__(self, config: JobConfig, output_dir: Path, rank: int, world_size: int, attempt_id: str):
        self.config, self.output_dir, self.rank, self.world_size = config, Path(output_dir), rank, world_size
        self.attempt, self.attempt_id = restart_attempt(), attempt_id
        self.events = EventLog(self.output_dir, rank, self.attempt)
        f = config.fault
        self.faults = FaultInjector(f.kind, f.step, f.rank, f.every, f.count, rank, self.attempt)
        self.guard: NonFiniteGuard | None = None
        self.step = 0
        self.parent = lifeline.arm()
        self.heartbeat: Heartbeat | None = None
        self.started = False

    def start(self, **details) -> None:
        """Begin writing to the output folder (once the run has decided it may use it): heartbeats and events."""
        w = self.config.watchdog
        self.started = True
        if w.enabled and self.heartbeat is None and (self.world_size > 1 or self.parent is not None):
            self.heartbeat = Heartbeat(self.output_dir / "heartbeats", self.rank, self.world_size, self.attempt_id,
                                       w.heartbeat_s, w.collective_timeout_s, self._on_verdict, self.parent)
            self.heartbeat.start()
        self.events.log("start", world_size=self.world_size, pid=os.getpid(), attempt_id=self.attempt_id, **details)

    # ------------------------------------------------------------------ fixed points of the loop
    def phase(self, name: str, comm: bool = False):
        return activity.phase(name, comm)

    def begin_step(self, step: int) -> None:
        """Step `step` (1-based) starts."""
        self.step = step
        activity.set_step(step)
        if self.heartbeat is not None:
            self.heartbeat.refresh()
        self.faults.at_step_start(step)

    def loss_factor(self, step: int) -> float | None:
        return self.faults.loss_factor(step)

    def attach_guard(self, group: dist.ProcessGroup | None, distributed: bool, replicas: int) -> None:
        g = self.config.guard
        self.guard = NonFiniteGuard(g.max_bad_steps, g.max_rollbacks, g.spike_zscore, g.spike_window, group, distributed,
                                    replicas, g.enabled)

    def check_update(self, local_loss_sum, grad_norm: float | None, total_tokens: int) -> Check:
        if self.guard is None or not self.guard.enabled:
            return Check(False, "", float("nan"))
        return self.guard.check(local_loss_sum, grad_norm, total_tokens)

    def after_step(self, check: Check, rollbacks: int, can_skip: bool) -> Action:
        """CONTINUE or ROLLBACK; a run that must stop raises TrainingFault naming the step and the reason."""
        if self.guard is None or not self.guard.enabled:
            return Action.CONTINUE
        if check.bad:
            self.events.log("bad_step", step=self.step, reason=check.reason, loss=check.loss)
        action = self.guard.after_step(check, rollbacks, can_skip)
        if action is Action.STOP:
            g = self.config.guard
            why = ("the gradient sync cannot withhold an update" if not can_skip else
                   f"{g.max_bad_steps} bad steps in a row after {rollbacks} rollback(s) (guard.max_rollbacks)")
            raise TrainingFault(f"training stopped at step {self.step}: {check.reason} ({why}); lower optim.lr or "
                                "check the data around that step")
        return action

    # ------------------------------------------------------------------ endings
    def finish(self, state: str = "finished") -> None:
        if self.heartbeat is not None:
            self.heartbeat.finish(state)
        self.events.log(state, step=self.step)

    def failed(self, exc: BaseException) -> None:
        """This rank ends with `exc`: record it, and the verdict if nothing earlier explained the failure.

        A ConfigError before `start` may mean the folder is not this run's to use (it holds another run,
        or is a file): then nothing is written there.
        """
        if not self.started and isinstance(exc, ConfigError):
            return
        self.events.error(exc, self.step)
        kind = classify(exc)
        if kind == "peer_failed":  # a consequence: the rank that failed first (or the launcher) tells the cause
            self.finish("failed")
            return
        write_failure(self.output_dir, {"kind": kind, "culprits": [self.rank], "step": self.step, "rank": self.rank,
                                        "attempt_id": self.attempt_id, "attempt": self.attempt,
                                        "lines": [f"rank {self.rank}: {type(exc).__name__}: {str(exc)[:500]}"]})
        self.finish("failed")

    def _on_verdict(self, verdict: Verdict) -> None:
        """Called on the heartbeat thread: report and end this process (the training thread may be blocked).

        Under `fivefold train` the launcher prints the verdict from failure.json; under a plain torchrun, this does.
        """
        if lifeline.LAUNCHER_ENV not in os.environ:
            print_verdict(verdict)
        self.events.log("verdict", kind=verdict.kind, culprits=verdict.culprits, step=verdict.step,
                        latency_s=verdict.latency_s, lines=verdict.lines)
        write_failure(self.output_dir, {"kind": verdict.kind, "culprits": verdict.culprits, "step": verdict.step,
                                        "rank": self.rank, "attempt_id": self.attempt_id, "attempt": self.attempt,
                                        "latency_s": verdict.latency_s, "lines": verdict.lines})
        sys.stderr.flush()
        if verdict.stopped_pid is not None:
            try:
                os.kill(verdict.stopped_pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(EXIT_LAUNCHER_DIED if verdict.kind == "launcher_died" else EXIT_FAULT)
