"""Discrete-event simulation of ranks running programs of compute and point-to-point messages.

Each rank runs one or more streams (a compute stream, a communication stream, as on a GPU), each
a list of operations executed in order:

    Compute(seconds)            the stream is busy for that long
    Delay(seconds)              the stream waits that long, off the host's cores (a sync point's
                                arrival skew: the other ranks' lateness, ClusterSpec.sync_delay)
    Send(peer, nbytes, handle)  post a message to global rank `peer` (returns at once)
    Recv(peer, nbytes, handle)  post a receive from `peer` (returns at once)
    Wait(handles)               block until those sends are delivered / receives have their data
    Notify(event) / Await(event)  order streams of one rank (CUDA events); a Notify whose event starts
                                with SNAPSHOT also keeps its stream's seconds per label so far
                                (`SimResult.snapshots`: the phases of one step of several)
    Collective(key, size, seconds)  the analytical fast path: a collective priced by its formula;
                                the stream waits until all `size` members have reached the op with
                                this key, then all are busy `seconds` together, off the network

Messages rendezvous: the k-th receive a rank posts from a peer takes the k-th message that peer
sent it (FIFO, as in MPI, gloo and NCCL), and the transfer starts once both are posted (as NCCL's
and gloo's large messages do, so an early sender cannot crowd a link its receiver still uses).
The network (network.py) decides when each message arrives; both handles complete then. With
`cores` (cores.py), the compute operations of the streams it names run as work on a host's shared
cores, faster while fewer of them compute. The result carries the step time, each rank's
finish time, the bytes each ordered pair of ranks exchanged, the bytes on each link, and spans
for a Chrome trace (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.sim.cores import SharedCores
from fivefold.sim.network import FlowNetwork


@dataclass(frozen=True)
class Compute:
    seconds: float
    label: str = "compute"


@dataclass(frozen=True)
class Delay:
    seconds: float
    label: str = "comm"


@dataclass(frozen=True)
class Send:
    peer: int
    nbytes: int
    handle: int


@dataclass(frozen=True)
class Recv:
    peer: int
    nbytes: int
    handle: int


@dataclass(frozen=True)
class Wait:
    handles: tuple[int, ...]
    label: str = "comm"


@dataclass(frozen=True)
class Notify:
    event: str


@dataclass(frozen=True)
class Await:
    event: str
    label: str = ""


@dataclass(frozen=True)
class Collective:
    key: tuple
    size: int
    seconds: float
    label: str = "comm"


Op = Compute | Delay | Send | Recv | Wait | Notify | Await | Collective
SNAPSHOT = "snapshot:"  # a Notify event with this prefix keeps its stream's labelled seconds
StreamKey = tuple[int, str]  # (global rank, stream name)


class SimulationError(RuntimeError):
    """The programs cannot finish: a receive with no matching send, or a wait on nothing posted."""


@dataclass
class Span:
    rank: int
    stream: str
    label: str
    start: float
    end: float


@dataclass
class SimResult:
    time: float
    finish: dict[StreamKey, float]
    pair_bytes: dict[tuple[int, int], int]
    link_bytes: list[float]
    spans: list[Span] = field(default_factory=list)
    labelled: dict[StreamKey, dict[str, float]] = field(default_factory=dict)  # seconds per span label, per stream
    events: dict[tuple[int, str], float] = field(default_factory=dict)  # (rank, event) -> when it was notified
    snapshots: dict[tuple[int, str], dict[str, float]] = field(default_factory=dict)  # (rank, SNAPSHOT event) ->
    # its stream's seconds per label when it was notified

    def chrome_trace(self) -> dict:
        """Chrome trace events: one process per rank, one thread per stream, times in microseconds."""
        streams = sorted({(s.rank, s.stream) for s in self.spans})
        thread = {key: index for index, key in enumerate(streams)}
        events = [{"name": "thread_name", "ph": "M", "pid": rank, "tid": thread[(rank, stream)],
                   "args": {"name": stream}} for rank, stream in streams]
        events += [{"name": s.label, "ph": "X", "pid": s.rank, "tid": thread[(s.rank, s.stream)],
                    "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6} for s in self.spans]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()), encoding="utf-8")


@dataclass
class _Stream:
    key: StreamKey
    ops: list[Op]
    pc: int = 0
    busy_until: float = 0.0
    blocked_since: float | None = None


def simulate(programs: dict[StreamKey, list[Op]], network: FlowNetwork, record_spans: bool = True,
             cores: SharedCores | None = None, shared: frozenset[StreamKey] = frozenset()) -> SimResult:
    """Run every stream's program to the end over `network`; raises SimulationError on a deadlock. The
    Compute operations of the `shared` streams run on `cores` (processor sharing)."""
    streams = {key: _Stream(key, list(ops)) for key, ops in programs.items()}
    of_rank: dict[int, list[StreamKey]] = defaultdict(list)
    for key in streams:
        of_rank[key[0]].append(key)
    done_handles: set[tuple[StreamKey, int]] = set()
    # Rendezvous per ordered (source, destination) pair, FIFO on both sides.
    sent: dict[tuple[int, int], deque] = defaultdict(deque)  # (sender stream, handle, bytes) not yet matched
    posted_recvs: dict[tuple[int, int], deque] = defaultdict(deque)  # (receiver stream, handle) not yet matched
    in_flight: dict[int, tuple[tuple[StreamKey, int], tuple[StreamKey, int]]] = {}  # message -> (sender, receiver)
    events: dict[tuple[int, str], float] = {}  # (rank, event) -> when first notified
    snapshots: dict[tuple[int, str], dict[str, float]] = {}
    pair_bytes: dict[tuple[int, int], int] = defaultdict(int)
    spans: list[Span] = []
    finish: dict[StreamKey, float] = {}
    ready: deque[StreamKey] = deque(streams)
    timers: list[tuple[float, StreamKey]] = []
    arrived: dict[tuple, list[tuple[StreamKey, float]]] = defaultdict(list)  # collective key -> (member, when)
    collecting: set[StreamKey] = set()  # streams waiting at a Collective for the other members

    labelled: dict[StreamKey, dict[str, float]] = defaultdict(dict)

    def mark(key: StreamKey, label: str, start: float, end: float) -> None:
        """A span of `key`'s time: added to its label's total, and kept whole when spans are recorded."""
        totals = labelled[key]
        totals[label] = totals.get(label, 0.0) + (end - start)
        if record_spans:
            spans.append(Span(key[0], key[1], label, start, end))

    def complete(owner: tuple[StreamKey, int]) -> None:
        done_handles.add(owner)
        ready.append(owner[0])

    def match(pair: tuple[int, int]) -> None:
        """Start the transfer of every send whose receive is posted too."""
        while sent[pair] and posted_recvs[pair]:
            sender, handle, nbytes = sent[pair].popleft()
            message = network.send(pair[0], pair[1], nbytes, key=(pair, handle))
            in_flight[message] = ((sender, handle), posted_recvs[pair].popleft())

    def run(stream: _Stream, now: float) -> None:
        """Execute the stream's operations that can complete at `now` (dispatch by exact type, the most
        frequent first: this loop is the simulator's hot path)."""
        rank, name = stream.key
        ops, count = stream.ops, len(stream.ops)
        while stream.pc < count and stream.busy_until <= now:
            op = ops[stream.pc]
            kind = type(op)
            if kind is Compute or kind is Delay:  # a Delay waits its time off the shared cores
                if kind is Compute and op.seconds > 0 and stream.key in shared:
                    cores.start(stream.key, op.seconds, now, op.label)
                    stream.busy_until = float("inf")  # until the cores finish it (then pc moves on)
                    return
                stream.busy_until = now + op.seconds
                if op.seconds > 0:
                    heapq.heappush(timers, (stream.busy_until, stream.key))
                    mark(stream.key, op.label, now, stream.busy_until)
            elif kind is Collective:
                if stream.key in collecting:
                    return
                members = arrived[op.key]
                members.append((stream.key, now))
                if len(members) < op.size:
                    collecting.add(stream.key)
                    return  # released (pc moved on) by the last member to arrive
                del arrived[op.key]
                end = now + op.seconds
                for member, since in members:
                    collecting.discard(member)
                    other = streams[member]
                    other.pc += 1
                    other.busy_until = end
                    heapq.heappush(timers, (end, member))
                    if end > since:
                        mark(member, op.label, since, end)
                continue
            elif kind is Wait or kind is Await:
                if kind is Wait:
                    waiting = not all((stream.key, h) in done_handles for h in op.handles)
                else:
                    waiting = (rank, op.event) not in events
                if waiting:
                    if stream.blocked_since is None:
                        stream.blocked_since = now
                    return
                if stream.blocked_since is not None and now > stream.blocked_since:
                    label = op.label if kind is Wait else (op.label or f"await {op.event}")
                    mark(stream.key, label, stream.blocked_since, now)
                stream.blocked_since = None
            elif kind is Send:
                pair_bytes[(rank, op.peer)] += op.nbytes
                sent[(rank, op.peer)].append((stream.key, op.handle, op.nbytes))
                match((rank, op.peer))
            elif kind is Recv:
                posted_recvs[(op.peer, rank)].append((stream.key, op.handle))
                match((op.peer, rank))
            elif kind is Notify:
                events.setdefault((rank, op.event), now)
                if op.event.startswith(SNAPSHOT):
                    snapshots[(rank, op.event)] = dict(labelled[stream.key])
                ready.extend(of_rank[rank])
            else:
                raise TypeError(f"not a simulator operation: {op!r}")
            stream.pc += 1
        if stream.pc == count and stream.key not in finish:
            finish[stream.key] = max(now, stream.busy_until)

    now = 0.0
    while True:
        while ready:
            run(streams[ready.popleft()], now)
        if len(finish) == len(streams) and not network.busy:
            break
        upcoming = min(timers[0][0] if timers else float("inf"), network.next_event(),
                       cores.next_event() if cores else float("inf"))
        if upcoming == float("inf"):
            stuck = [f"rank {s.key[0]} stream {s.key[1]} at op {s.pc}: {s.ops[s.pc]}" for s in streams.values()
                     if s.pc < len(s.ops)][:8]
            raise SimulationError("the simulated ranks deadlock (a receive with no matching send, or a wait on "
                                  "nothing in flight): " + "; ".join(stuck))
        for message in network.advance(upcoming):
            sender, receiver = in_flight.pop(message)
            complete(sender)
            complete(receiver)
        now = upcoming
        for key, start, label in cores.advance_to(now) if cores else ():
            streams[key].busy_until = now
            streams[key].pc += 1
            mark(key, label, start, now)
            ready.append(key)
        while timers and timers[0][0] <= now:
            ready.append(heapq.heappop(timers)[1])
    return SimResult(max(finish.values(), default=0.0), finish, dict(pair_bytes),
                     network.link_bytes.tolist(), spans, dict(labelled), events, snapshots)
