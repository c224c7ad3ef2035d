"""Fault injection (`[fault]`): make a run fail on purpose, at a chosen step and rank, the way real runs fail.

For the tests, the fault benchmark and the labelled corpus of `fivefold diagnose`; like torchft's
and NVIDIA's resiliency tools, it runs inside the real training path, so what is exercised is what
runs in production.

    kill          the rank SIGKILLs itself at the start of the step (a dead process, an OOM kill)
    hang          the rank SIGSTOPs itself (a frozen process: the watchdog must name it)
    stall         the rank sleeps inside a compute phase with its heartbeat alive (a stuck kernel;
                  the others wait in a collective until watchdog.collective_timeout_s)
    exception     the rank raises RuntimeError (a bug)
    oom           the rank raises torch.OutOfMemoryError (CUDA) or MemoryError (CPU)
    nan           the rank's loss is multiplied by NaN before backward (`count` steps in a row)
    spike         the loss is multiplied by 1000 before backward (`count` steps in a row)
    corrupt_save  after checkpoint `step` is published, rank 0 flips 16 bytes in the middle of its largest
                  state file (a bad disk or copy)
    disk_full     the checkpoint write at `step` fails with ENOSPC on every rank (a full shared disk)

`fault.rank = -1` makes every rank fail at once (a preempted job). With `every` > 0 the fault repeats every `every` steps, the k-th occurrence only in the k-th
attempt of a run restarted by `--max-restarts` (TORCHELASTIC_RESTART_COUNT = k), so a restart that
resumes before the fault's step does not meet it again; without it the fault fires in the first
attempt only.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import torch

from fivefold.reliability.activity import phase

FAULT_KINDS = ("none", "kill", "hang", "stall", "exception", "oom", "nan", "spike", "corrupt_save", "disk_full")
STEP_FAULTS = ("kill", "hang", "stall", "exception", "oom")
LOSS_FAULTS = ("nan", "spike")


def restart_attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class FaultInjector:
    """Fires the configured fault at fixed points of the loop (step start, loss, checkpoint write)."""

    def __init__(self, kind: str, step: int, rank: int, every: int, count: int, this_rank: int,
                 attempt: int | None = None):
        self.kind, self.step, self.rank, self.every, self.count = kind, step, rank, every, max(count, 1)
        self.this_rank = this_rank
        self.attempt = restart_attempt() if attempt is None else attempt

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def _fires(self, step: int, any_rank: bool = False) -> bool:
        if not self.active or (not any_rank and self.rank not in (-1, self.this_rank)) or step < self.step:
            return False
        offset = step - self.step
        occurrence = offset // self.every if self.every > 0 else 0
        if self.every > 0:
            offset -= occurrence * self.every
        return occurrence == self.attempt and offset < self.count

    def at_step_start(self, step: int) -> None:
        """Step `step` (1-based, the step about to run) begins."""
        if self.kind not in STEP_FAULTS or not self._fires(step):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "stall":
            with phase(f"forward (injected stall at step {step})"):
                time.sleep(3600)
        elif self.kind == "exception":
            raise RuntimeError(f"injected failure at step {step} on rank {self.this_rank} (fault.kind = exception)")
        elif self.kind == "oom":
            if torch.cuda.is_available():
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected at step {step}, fault.kind = oom)")
            raise MemoryError(f"out of memory (injected at step {step} on rank {self.this_rank}, fault.kind = oom)")

    def loss_factor(self, step: int) -> float | None:
        """A factor to multiply this rank's loss by before backward, or None."""
        if self.kind not in LOSS_FAULTS or not self._fires(step):
            return None
        return float("nan") if self.kind == "nan" else 1000.0

    def before_write(self, folder: Path, step: int) -> None:
        if self.kind == "disk_full" and self._fires(step, any_rank=True):
            raise OSError(errno.ENOSPC, f"No space left on device (injected at checkpoint step {step}, "
                                        "fault.kind = disk_full)", str(folder))

    def after_write(self, folder: Path, step: int) -> None:
        if self.kind != "corrupt_save" or not self._fires(step, any_rank=True) or self.this_rank != 0:
            return
        target = max((p for p in (folder / "state").glob("*.distcp")), key=lambda p: p.stat().st_size)
        with open(target, "r+b") as handle:
            handle.seek(target.stat().st_size // 2)
            data = bytearray(handle.read(16))
            handle.seek(target.stat().st_size // 2)
            handle.write(bytes(b ^ 0xFF for b in data))
