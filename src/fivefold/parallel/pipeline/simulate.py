"""Run every rank's instruction stream together in pure Python: check it, time it, measure it.

Sends are asynchronous (they complete into the channel); a receive blocks until the matching
message has been sent. Messages between two ranks must be received in the order they were sent
(what NCCL guarantees and gloo's untagged point-to-point relies on): a receive that finds a
different message at the head of its channel is a schedule error, and a state where no rank can
move while some have instructions left is a deadlock. Both raise ScheduleError naming the ranks
and instructions.

Compute passes take the given times (forward, full backward, input-gradient, weight-gradient),
optionally scaled per stage (the planner's uneven stages: the head on the last);
communication takes `latency`. The result gives the step time (makespan), the bubble (idle
share of the ranks' time), the peak number of micro-batches each rank holds activations for
(a forward whose backward, or input-gradient pass, has not run), the peak number of weight-
gradient passes waiting, and the timeline the plots draw.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fivefold.parallel.pipeline.schedules import COMPUTE, Instruction, Op
from fivefold.errors import FivefoldError


class ScheduleError(FivefoldError, RuntimeError):
    """An instruction stream that cannot run: a send without its receive, a pass before its input."""


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    backward: float = 2.0  # input + weight gradient
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0
    stage_scale: tuple[float, ...] = ()  # per (virtual) stage multiplier of the compute times; () = all 1

    def of(self, op: Op, stage: int = -1) -> float:
        base = {Op.FORWARD: self.forward, Op.BACKWARD: self.backward, Op.BACKWARD_INPUT: self.backward_input,
                Op.BACKWARD_WEIGHT: self.backward_weight}.get(op, 0.0)
        return base * self.stage_scale[stage] if self.stage_scale and stage >= 0 else base


@dataclass
class Simulation:
    makespan: float
    busy: dict[int, float]
    peak_in_flight: dict[int, int]
    peak_pending_weight: dict[int, int]  # input gradient done, weight gradient not yet (zero bubble)
    timeline: list[tuple[int, Instruction, float, float]] = field(default_factory=list)  # rank, what, start, end

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step: (p x makespan - busy) / (p x makespan)."""
        total = len(self.busy) * self.makespan
        return (total - sum(self.busy.values())) / total

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time over compute time (Narayanan et al.'s bubble ratio), averaged over ranks."""
        return sum(self.makespan - b for b in self.busy.values()) / sum(self.busy.values())


_MESSAGE = {Op.SEND_ACT: "act", Op.RECV_ACT: "act", Op.SEND_GRAD: "grad", Op.RECV_GRAD: "grad"}


def simulate(streams: dict[int, list[Instruction]], costs: Costs = Costs()) -> Simulation:
    ranks = sorted(streams)
    position = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    busy = {r: 0.0 for r in ranks}
    in_flight = {r: set() for r in ranks}
    peak = {r: 0 for r in ranks}
    pending_weight = {r: set() for r in ranks}
    peak_weight = {r: 0 for r in ranks}
    channels: dict[tuple[int, int], deque] = {}
    timeline = []
    while any(position[r] < len(streams[r]) for r in ranks):
        moved = False
        for r in ranks:
            while position[r] < len(streams[r]):
                ins = streams[r][position[r]]
                start = clock[r]
                if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    channel = channels.get((ins.peer, r))
                    if not channel:
                        break  # blocked until the peer sends
                    kind, microbatch, sent_at = channel[0]
                    if (kind, microbatch) != (_MESSAGE[ins.op], ins.microbatch):
                        raise ScheduleError(f"rank {r} expects {ins} but the next message from rank {ins.peer} "
                                            f"is {kind} of micro-batch {microbatch}")
                    channel.popleft()
                    start = max(start, sent_at)
                    end = start
                elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    end = start + costs.latency
                    channels.setdefault((r, ins.peer), deque()).append((_MESSAGE[ins.op], ins.microbatch, end))
                else:
                    end = start + costs.of(ins.op, ins.stage)
                    busy[r] += end - start
                    key = (ins.microbatch, ins.stage)
                    if ins.op == Op.FORWARD:
                        in_flight[r].add(key)
                        peak[r] = max(peak[r], len(in_flight[r]))
                    elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                        in_flight[r].discard(key)
                        if ins.op == Op.BACKWARD_INPUT:
                            pending_weight[r].add(key)
                            peak_weight[r] = max(peak_weight[r], len(pending_weight[r]))
                    else:
                        pending_weight[r].discard(key)
                if ins.op in COMPUTE:
                    timeline.append((r, ins, start, end))
                clock[r] = end
                position[r] += 1
                moved = True
        if not moved:
            blocked = {r: str(streams[r][position[r]]) for r in ranks if position[r] < len(streams[r])}
            raise ScheduleError(f"deadlock: every unfinished rank waits on a message never sent: {blocked}")
    return Simulation(max(clock.values()), busy, peak, peak_weight, timeline)
