"""What this rank is doing right now: the phase stack of each thread, and a sequence number of communication.

The trainer marks its phases (step N, forward/backward, optimizer, evaluation, checkpoint) and the
communication code marks each blocking wait (all-reduce of bucket 3 of 7, pipeline receive of
micro-batch 2 from rank 5, ZeRO all-gather of unit 4, ring-attention step, all-to-all, barrier):

    with activity.phase("all-reduce bucket 3/7", comm=True):
        work.wait()

Each `comm` phase takes the next sequence number, so when a job stalls, the heartbeat records
(reliability/heartbeat.py) show which collective every rank was in and which rank is behind
(PyTorch's NCCL flight recorder keeps the same per-rank sequence for the same purpose).

The recorder is process-wide state, like the process groups it describes: the code that issues
a collective and the heartbeat thread that reports it are far apart, and threading a recorder
object through every collective call would tie the parallelism code to fault handling. Entering
and leaving a phase costs a few attribute writes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Frame:
    name: str
    comm: bool
    since: float  # time.monotonic() at entry
    seq: int  # communication sequence number at entry


@dataclass
class ThreadActivity:
    stack: list[Frame] = field(default_factory=list)


class ActivityRecorder:
    """Phase stacks per thread; `snapshot()` is what a heartbeat publishes."""

    def __init__(self) -> None:
        self._threads: dict[int, tuple[str, ThreadActivity]] = {}
        self._lock = threading.Lock()
        self.seq = 0  # communication phases entered so far, all threads
        self.step = 0
        self.blocked: dict[str, float] = {}  # seconds spent inside communication phases, by name, all threads

    def _mine(self) -> ThreadActivity:
        ident = threading.get_ident()
        entry = self._threads.get(ident)
        if entry is None:
            with self._lock:
                entry = self._threads[ident] = (threading.current_thread().name, ThreadActivity())
        return entry[1]

    @contextlib.contextmanager
    def phase(self, name: str, comm: bool = False):
        stack = self._mine().stack
        if comm:
            self.seq += 1
        frame = Frame(name, comm, time.monotonic(), self.seq)
        stack.append(frame)
        try:
            yield
        finally:
            stack.pop()
            if comm:
                elapsed = time.monotonic() - frame.since
                with self._lock:
                    self.blocked[name] = self.blocked.get(name, 0.0) + elapsed

    def snapshot(self) -> dict:
        """{'step', 'seq', 'threads': {name: {'phases': [...], 'comm': bool, 'age_s': float}}} for a heartbeat."""
        now = time.monotonic()
        threads = {}
        with self._lock:
            entries = list(self._threads.values())
        for name, activity in entries:
            stack = list(activity.stack)
            if not stack:
                continue
            top = stack[-1]
            threads[name] = {"phases": [f.name for f in stack], "comm": top.comm, "age_s": round(now - top.since, 3),
                             "seq": top.seq}
        return {"step": self.step, "seq": self.seq, "threads": threads}

    def main_thread(self) -> dict | None:
        return self.snapshot()["threads"].get(threading.main_thread().name)


ACTIVITY = ActivityRecorder()


def phase(name: str, comm: bool = False):
    """Mark what this thread is doing for the heartbeat (a context manager)."""
    return ACTIVITY.phase(name, comm)


def blocked_seconds(prefix: str) -> float:
    """Seconds this process has spent waiting in communication phases whose name starts with `prefix`: the
    exposed communication of that kind (what ran while nothing else could)."""
    with ACTIVITY._lock:
        return sum(seconds for name, seconds in ACTIVITY.blocked.items() if name.startswith(prefix))


def set_step(step: int) -> None:
    ACTIVITY.step = step
