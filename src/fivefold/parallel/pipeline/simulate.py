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

With `Costs.sharing` the ranks are processes sharing one host's cores (a CPU run with more ranks than
cores): the given times are those of every rank computing at once, and a rank in its bubble lends its
cores to the others, so a pass runs faster the fewer ranks compute beside it (processor sharing: the
rates change whenever a pass starts or ends, and the simulation steps from one such event to the next).
Accelerators never lend their compute, so the GPU presets leave it unset.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fivefold.parallel.pipeline.schedules import COMPUTE, Instruction, Op
from fivefold.errors import FivefoldError


class ScheduleError(FivefoldError, RuntimeError):
    """An instruction stream that cannot run: a send without its receive, a pass before its input."""


@dataclass(frozen=True)
class CoreSharing:
    """Ranks of one host sharing its cores: `cores` cores, `replicas` ranks running each pipeline rank's
    passes in lock step on the host (its data-, tensor- and context-parallel copies), `threads` intra-op
    threads per rank (the runtime's cap: cores // ranks, at least 1), and `efficiency`: the host's
    throughput with more threads than cores over its throughput with as many (measured: time-slicing
    costs switches and caches; 1 = ideal sharing)."""

    cores: int
    replicas: int = 1
    threads: int = 1
    efficiency: float = 1.0

    def speed(self, active: int, ranks: int) -> float:
        """A computing rank's rate while `active` of the `ranks` pipeline ranks compute, relative to its rate
        when all compute (the rate the given pass times were measured at): 1 if all ranks' threads fit
        the cores (and the active ones do: `active` may exceed `ranks` when a rank's second thread computes
        too, a gradient codec's, sim/workload.py; then cores / (active x threads) x efficiency); if the
        computing ranks' threads fit, the whole share of a core per thread, which is ranks x replicas x
        threads / cores / efficiency times the shared rate; else the cores shared among the computing
        threads, ranks / active."""
        per_rank = self.replicas * self.threads
        if ranks * per_rank <= self.cores:
            if active * per_rank <= self.cores:
                return 1.0
            return self.cores / (active * per_rank) * self.efficiency
        active = max(active, 1)
        if active * per_rank <= self.cores:
            return ranks * per_rank / self.cores / self.efficiency
        return ranks / active


@dataclass(frozen=True)
class Costs:
    forward: float = 1.0
    backward: float = 2.0  # input + weight gradient
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0
    stage_scale: tuple[float, ...] = ()  # per (virtual) stage multiplier of the compute times; () = all 1
    sharing: CoreSharing | None = None  # ranks sharing a host's cores (CPU); None: each computes on its own

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
    work: dict[int, float] = field(default_factory=dict)  # the given pass times summed: busy, unless cores are shared

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
_RECEIVES = (Op.RECV_ACT, Op.RECV_GRAD)
_SENDS = (Op.SEND_ACT, Op.SEND_GRAD)


class _Ledger:
    """What both simulations record of a finished pass: busy time, given work, the activations and
    weight-gradient passes each rank holds, and the timeline."""

    def __init__(self, ranks: list[int], costs: Costs) -> None:
        self.costs = costs
        self.busy = {r: 0.0 for r in ranks}
        self.work = {r: 0.0 for r in ranks}
        self.in_flight = {r: set() for r in ranks}
        self.peak = {r: 0 for r in ranks}
        self.pending_weight = {r: set() for r in ranks}
        self.peak_weight = {r: 0 for r in ranks}
        self.timeline: list[tuple[int, Instruction, float, float]] = []

    def computed(self, r: int, ins: Instruction, start: float, end: float) -> None:
        self.busy[r] += end - start
        self.work[r] += self.costs.of(ins.op, ins.stage)
        key = (ins.microbatch, ins.stage)
        if ins.op == Op.FORWARD:
            self.in_flight[r].add(key)
            self.peak[r] = max(self.peak[r], len(self.in_flight[r]))
        elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            self.in_flight[r].discard(key)
            if ins.op == Op.BACKWARD_INPUT:
                self.pending_weight[r].add(key)
                self.peak_weight[r] = max(self.peak_weight[r], len(self.pending_weight[r]))
        else:
            self.pending_weight[r].discard(key)
        if ins.op in COMPUTE:
            self.timeline.append((r, ins, start, end))

    def result(self, makespan: float) -> Simulation:
        return Simulation(makespan, self.busy, self.peak, self.peak_weight, self.timeline, self.work)


def _head_message(channels: dict[tuple[int, int], deque], r: int, ins: Instruction) -> float | None:
    """When the message `ins` receives was (or will be) delivered; None if it is not sent yet. A different
    message at the head of the channel is a schedule error."""
    channel = channels.get((ins.peer, r))
    if not channel:
        return None
    kind, microbatch, sent_at = channel[0]
    if (kind, microbatch) != (_MESSAGE[ins.op], ins.microbatch):
        raise ScheduleError(f"rank {r} expects {ins} but the next message from rank {ins.peer} "
                            f"is {kind} of micro-batch {microbatch}")
    return sent_at


def _deadlock(streams: dict[int, list[Instruction]], position: dict[int, int]) -> ScheduleError:
    blocked = {r: str(streams[r][position[r]]) for r in streams if position[r] < len(streams[r])}
    return ScheduleError(f"deadlock: every unfinished rank waits on a message never sent: {blocked}")


def simulate(streams: dict[int, list[Instruction]], costs: Costs = Costs()) -> Simulation:
    if costs.sharing is not None:
        return _simulate_shared(streams, costs)
    ranks = sorted(streams)
    position = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    ledger = _Ledger(ranks, costs)
    channels: dict[tuple[int, int], deque] = {}
    while any(position[r] < len(streams[r]) for r in ranks):
        moved = False
        for r in ranks:
            while position[r] < len(streams[r]):
                ins = streams[r][position[r]]
                start = clock[r]
                if ins.op in _RECEIVES:
                    sent_at = _head_message(channels, r, ins)
                    if sent_at is None:
                        break  # blocked until the peer sends
                    channels[(ins.peer, r)].popleft()
                    start = end = max(start, sent_at)
                elif ins.op in _SENDS:
                    end = start + costs.latency
                    channels.setdefault((r, ins.peer), deque()).append((_MESSAGE[ins.op], ins.microbatch, end))
                else:
                    end = start + costs.of(ins.op, ins.stage)
                    ledger.computed(r, ins, start, end)
                clock[r] = end
                position[r] += 1
                moved = True
        if not moved:
            raise _deadlock(streams, position)
    return ledger.result(max(clock.values()))


def _simulate_shared(streams: dict[int, list[Instruction]], costs: Costs) -> Simulation:
    """Processor sharing: every computing rank runs at `sharing.speed(computing ranks)`; time steps from
    one event (a pass or send ending, a message arriving) to the next."""
    ranks = sorted(streams)
    position = {r: 0 for r in ranks}
    ledger = _Ledger(ranks, costs)
    channels: dict[tuple[int, int], deque] = {}
    computing: dict[int, list] = {}  # rank -> [work left at the all-computing rate, start]
    until: dict[int, float] = {}  # rank -> when its send ends, or when the message it waits for arrives
    now = 0.0
    while True:
        moved = True
        while moved:  # start what can start now (a send of no latency may release a receive)
            moved = False
            for r in ranks:
                while r not in computing and r not in until and position[r] < len(streams[r]):
                    ins = streams[r][position[r]]
                    if ins.op in _RECEIVES:
                        sent_at = _head_message(channels, r, ins)
                        if sent_at is None:
                            break
                        if sent_at > now:
                            until[r] = sent_at
                            break
                        channels[(ins.peer, r)].popleft()
                    elif ins.op in _SENDS:
                        channels.setdefault((r, ins.peer), deque()).append(
                            (_MESSAGE[ins.op], ins.microbatch, now + costs.latency))
                        if costs.latency > 0:
                            until[r] = now + costs.latency
                    elif ins.op not in COMPUTE:  # the gradient reduction and optimizer step: no time here
                        ledger.computed(r, ins, now, now)
                    else:
                        computing[r] = [costs.of(ins.op, ins.stage), now]
                        break
                    position[r] += 1
                    moved = True
        if not computing and not until:
            if any(position[r] < len(streams[r]) for r in ranks):
                raise _deadlock(streams, position)
            return ledger.result(now)
        speed = costs.sharing.speed(len(computing), len(ranks))
        step = min([left / speed for left, _ in computing.values()] + [t - now for t in until.values()])
        now += step
        for r in list(computing):
            entry = computing[r]
            entry[0] -= step * speed
            if entry[0] <= 1e-12 * max(1.0, now):
                ins = streams[r][position[r]]
                ledger.computed(r, ins, entry[1], now)
                del computing[r]
                position[r] += 1
        for r in [r for r, t in until.items() if t <= now]:
            del until[r]
            if streams[r][position[r]].op in _SENDS:
                position[r] += 1  # a send ends; a receive's message has arrived: it is taken on the next pass
