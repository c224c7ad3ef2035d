"""Processor sharing of one CPU host's cores among its ranks' compute streams.

On a CPU run with more rank threads than cores (this project's 2-core machine at 4 ranks), the
compute times the planner gives are those of every rank computing at once: the rates were measured
that way. A rank that waits (a pipeline bubble, a collective) gives its share of the cores to the
ranks still computing, which then run faster, the way an operating system shares cores among
runnable processes. The engine (engine.py) hands the compute stream's `Compute` operations of
such a host to `SharedCores`, which plays them as work at a rate that changes whenever a pass
starts or ends: with n of the host's N ranks computing, t threads each, on c cores, a pass runs
at min(1, c / (n t)) / min(1, c / (N t)) of its given speed (the same rule as the planner's
pipeline simulation, parallel/pipeline/simulate.py `CoreSharing`). Accelerators do not lend
compute, so GPU clusters (accelerator.shared_cores = 0) never use it.
"""

from __future__ import annotations

from fivefold.parallel.pipeline.simulate import CoreSharing


class SharedCores:
    """The compute passes running on one host; `weight` real ranks per simulated one (the analytical path
    simulates one rank per pipeline stage for all its identical copies)."""

    def __init__(self, sharing: CoreSharing, ranks: int, weight: int = 1) -> None:
        self.sharing = sharing
        self.ranks = ranks
        self.weight = weight
        self.running: dict = {}  # stream -> [work left at the all-computing rate, start, label]
        self.clock = 0.0

    def _speed(self) -> float:
        return self.sharing.speed(len(self.running) * self.weight, self.ranks)

    def start(self, stream, seconds: float, now: float, label: str) -> None:
        """A pass of `seconds` (at the all-computing rate) begins; the engine has advanced the cores to `now`."""
        if self.running and now != self.clock:
            raise RuntimeError(f"SharedCores.start at {now} s with the passes run only to {self.clock} s: "
                               "advance_to(now) first")
        self.clock = now
        self.running[stream] = [seconds, now, label]

    def next_event(self) -> float:
        if not self.running:
            return float("inf")
        speed = self._speed()
        return self.clock + min(left for left, _, _ in self.running.values()) / speed

    def advance_to(self, now: float) -> list[tuple[object, float, str]]:
        """Run the passes to `now`; returns (stream, start, label) of those that end by then."""
        if now <= self.clock or not self.running:
            self.clock = max(self.clock, now)
            return []
        done_by = 1e-12 * max(1.0, now)  # rounding of the event time, far below a pass
        work = (now - self.clock) * self._speed()
        finished = []
        for stream, entry in list(self.running.items()):
            entry[0] -= work
            if entry[0] <= done_by:
                finished.append((stream, entry[1], entry[2]))
                del self.running[stream]
        self.clock = now
        return finished
