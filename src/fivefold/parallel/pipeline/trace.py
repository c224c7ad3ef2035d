"""Measured pipeline timelines: the bubble fraction and a Chrome trace of one training step.

The executor times every instruction it runs on its rank (seconds from a barrier at the start of
the step). From all pipeline ranks' events:

    measured bubble = sum over ranks of (T - busy_r) / sum over ranks of busy_r

with busy_r the rank's forward/backward compute time and T the step's makespan up to the last
compute pass (gradient sync and optimizer step excluded): idle time over compute time, the
quantity Narayanan et al. give as (p-1)/m for equal stages, so the two can be put side by side.
Waiting for a message counts as idle.

The Chrome trace (chrome://tracing, https://ui.perfetto.dev) has one process per pipeline rank
with two rows, compute and communication.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fivefold.parallel.pipeline.executor import TimedEvent

_NOT_PIPELINE_WORK = ("optimizer step",)


@dataclass(frozen=True)
class MeasuredBubble:
    makespan: float  # seconds, start of step to the last compute pass on any rank
    busy: tuple[float, ...]  # compute seconds per rank

    @property
    def over_ideal(self) -> float:
        """Idle time over compute time, summed over ranks."""
        return sum(self.makespan - b for b in self.busy) / sum(self.busy)

    @property
    def fraction(self) -> float:
        """Idle share of all ranks' time."""
        return sum(self.makespan - b for b in self.busy) / (len(self.busy) * self.makespan)


def _compute(events: list[TimedEvent]) -> list[TimedEvent]:
    return [e for e in events if e.category == "compute" and e.name not in _NOT_PIPELINE_WORK]


def measure_bubble(events_by_rank: list[list[TimedEvent]]) -> MeasuredBubble:
    makespan = max(max((e.end for e in _compute(events)), default=0.0) for events in events_by_rank)
    busy = tuple(sum(e.end - e.start for e in _compute(events)) for events in events_by_rank)
    return MeasuredBubble(makespan, busy)


def chrome_trace(events_by_rank: list[list[TimedEvent]], info: dict) -> dict:
    """The trace-event JSON object: complete ("X") events in microseconds, one process per rank.

    `info` (schedule, ranks, microbatches, virtual, step) goes into otherData, for `plot_trace`.
    """
    out = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pipeline rank {rank}"}}
           for rank in range(len(events_by_rank))]
    for rank in range(len(events_by_rank)):
        for tid, row in enumerate(("compute", "comm")):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row}})
    for rank, events in enumerate(events_by_rank):
        for e in events:
            out.append({"name": e.name, "cat": e.category, "ph": "X", "pid": rank,
                        "tid": 0 if e.category == "compute" else 1,
                        "ts": round(e.start * 1e6, 3), "dur": round((e.end - e.start) * 1e6, 3)})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": info}


def write_chrome_trace(path: Path, events_by_rank: list[list[TimedEvent]], info: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events_by_rank, info)))
    return path
