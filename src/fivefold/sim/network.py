"""Flow-level network: messages become flows whose rates are max-min fair over the links they cross.

A message from one accelerator to another becomes one flow (or several, under ecmp_paths) routed
by routing.py. A flow waits out its route's latency, then transfers at a rate set by max-min
fairness over all flows in transfer (Bertsekas & Gallager, "Data Networks", 6.5.2): rates rise
together until some link is full; the flows crossing it are frozen at that rate; the rest keep
rising until every flow crosses a full link. A sprayed flow uses each link in proportion to the
share of it the link carries (weighted progressive filling). Rates are recomputed whenever a flow
starts or ends, the standard flow-level approximation of a packet network (what SimGrid and
ASTRA-sim's analytical backend do): no packets, no queues, no congestion control.

In isolation a message of n bytes takes latency + n / bandwidth over its slowest link: the alpha-
beta model. The network also counts the bytes each link carried, for utilisation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from fivefold.sim.routing import Route, Router

_DONE_RELATIVE = 1e-9  # a flow with at most this fraction of its bytes left has finished


@dataclass
class _Flow:
    message: int
    size: float
    left: float
    route: Route


@dataclass
class FlowNetwork:
    """Flows over `router.topology`; the caller advances time from event to event."""

    router: Router
    now: float = 0.0
    link_bytes: np.ndarray = field(init=False)
    _capacity: np.ndarray = field(init=False)
    _flows: dict[int, _Flow] = field(default_factory=dict)
    _starting: list[tuple[float, int, int]] = field(default_factory=list)  # (time, flow, message)
    _parked: dict[int, _Flow] = field(default_factory=dict)
    _unfinished: dict[int, int] = field(default_factory=dict)  # message -> flows not yet delivered
    _instant: list[tuple[float, int]] = field(default_factory=list)  # (time, message): nothing to transfer
    _rates: np.ndarray | None = None
    _pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    _ids: list[int] = field(default_factory=list)
    _next_flow: int = 0
    _next_message: int = 0

    def __post_init__(self) -> None:
        links = self.router.topology.links
        self._capacity = np.array([link.bandwidth for link in links], dtype=float)
        self.link_bytes = np.zeros(len(links))

    def send(self, source: int, destination: int, nbytes: float, key: object = None) -> int:
        """Start a message now; returns its id (reported by `advance` when delivered)."""
        message = self._next_message
        self._next_message += 1
        parts = self.router.split(source, destination, (key, message) if key is None else key)
        self._unfinished[message] = len(parts)
        for part_key, share in parts:
            route = self.router.route(source, destination, part_key)
            start = self.now + self.router.path_latency(route)
            flow = _Flow(message, nbytes * share, nbytes * share, route)
            if not route or flow.size <= 0:
                heapq.heappush(self._instant, (start, message))
                continue
            self._parked[self._next_flow] = flow
            heapq.heappush(self._starting, (start, self._next_flow, message))
            self._next_flow += 1
        return message

    # ----------------------------------------------------------------- rates
    def _update_rates(self) -> None:
        self._ids = list(self._flows)
        if not self._ids:
            self._rates, self._pairs = None, None
            return
        routes = [self._flows[i].route for i in self._ids]
        lengths = np.fromiter((len(r) for r in routes), dtype=np.int64, count=len(routes))
        flow_of = np.repeat(np.arange(len(routes)), lengths)
        link_of = np.fromiter((link for r in routes for link, _ in r), dtype=np.int64, count=int(lengths.sum()))
        weight = np.fromiter((w for r in routes for _, w in r), dtype=float, count=int(lengths.sum()))
        self._pairs = (flow_of, link_of, weight)
        self._rates = max_min_rates(flow_of, link_of, weight, self._capacity, len(routes))

    def next_event(self) -> float:
        """Time of the next flow start, flow end or instant delivery (inf when idle)."""
        times = [self._starting[0][0]] if self._starting else []
        if self._instant:
            times.append(self._instant[0][0])
        if self._flows:
            left = np.array([self._flows[i].left for i in self._ids])
            end = self.now + float(np.min(left / self._rates))
            # a flow ending sooner than the clock can resolve still ends: at the next representable time
            times.append(end if end > self.now else float(np.nextafter(self.now, np.inf)))
        return min(times, default=float("inf"))

    def advance(self, until: float) -> list[int]:
        """Move time to `until` (at most `next_event()`); returns the messages delivered by then, in order."""
        delivered: list[int] = []
        if self._flows and until > self.now:
            elapsed = until - self.now
            flow_of, link_of, weight = self._pairs
            np.add.at(self.link_bytes, link_of, weight * self._rates[flow_of] * elapsed)
            finished = []
            for position, flow_id in enumerate(self._ids):
                flow = self._flows[flow_id]
                flow.left -= self._rates[position] * elapsed
                if flow.left <= _DONE_RELATIVE * flow.size:
                    finished.append(flow_id)
            for flow_id in finished:
                self._finish(self._flows.pop(flow_id).message, delivered)
            changed = bool(finished)
        else:
            changed = False
        self.now = max(self.now, until)
        while self._instant and self._instant[0][0] <= self.now:
            self._finish(heapq.heappop(self._instant)[1], delivered)
        while self._starting and self._starting[0][0] <= self.now:
            _, flow_id, _ = heapq.heappop(self._starting)
            self._flows[flow_id] = self._parked.pop(flow_id)
            changed = True
        if changed:
            self._update_rates()
        return delivered

    def _finish(self, message: int, delivered: list[int]) -> None:
        self._unfinished[message] -= 1
        if not self._unfinished[message]:
            del self._unfinished[message]
            delivered.append(message)

    @property
    def busy(self) -> bool:
        return bool(self._flows or self._starting or self._instant)

    def rates(self) -> dict[int, float]:
        """The current rate (bytes/s) of each message's flows in transfer, summed per message."""
        out: dict[int, float] = {}
        for position, flow_id in enumerate(self._ids):
            message = self._flows[flow_id].message
            out[message] = out.get(message, 0.0) + float(self._rates[position])
        return out


def max_min_rates(flow_of: np.ndarray, link_of: np.ndarray, weight: np.ndarray, capacity: np.ndarray,
                  flows: int) -> np.ndarray:
    """Weighted max-min fair rates by progressive filling.

    (flow_of[k], link_of[k], weight[k]): flow flow_of[k] puts weight[k] times its rate on link
    link_of[k]. All rates rise together until a link is full; its flows freeze; repeat.
    """
    used, local = np.unique(link_of, return_inverse=True)
    remaining = capacity[used].astype(float).copy()
    full = 1e-12 * capacity[used]
    rates = np.zeros(flows)
    frozen = np.zeros(flows, dtype=bool)
    while not frozen.all():
        live = ~frozen[flow_of]
        slope = np.bincount(local[live], weights=weight[live], minlength=len(used))
        loaded = slope > 0
        step = float(np.min(remaining[loaded] / slope[loaded]))
        rates[~frozen] += step
        remaining -= step * slope
        saturated = loaded & (remaining <= full)
        saturated[np.argmin(np.where(loaded, remaining / np.where(loaded, slope, 1), np.inf))] = True
        frozen[flow_of[live & saturated[local]]] = True
    return rates


@dataclass
class DedicatedNetwork:
    """The analytical network: every message has its route to itself, so n bytes take the route's
    latency + n / its slowest link's bandwidth (the alpha-beta model, no contention). Same interface
    as FlowNetwork, at a fraction of its cost: nothing is shared, so nothing is recomputed."""

    router: Router
    now: float = 0.0
    link_bytes: np.ndarray = field(init=False)
    _arrivals: list[tuple[float, int]] = field(default_factory=list)
    _next_message: int = 0

    def __post_init__(self) -> None:
        self._bandwidth = [link.bandwidth for link in self.router.topology.links]
        self.link_bytes = np.zeros(len(self._bandwidth))

    def send(self, source: int, destination: int, nbytes: float, key: object = None) -> int:
        message = self._next_message
        self._next_message += 1
        route = self.router.route(source, destination, (key, message) if key is None else key)
        seconds = self.router.path_latency(route)
        if route and nbytes > 0:
            seconds += nbytes / min(self._bandwidth[link] / weight for link, weight in route)
            for link, weight in route:
                self.link_bytes[link] += weight * nbytes
        heapq.heappush(self._arrivals, (self.now + seconds, message))
        return message

    def next_event(self) -> float:
        return self._arrivals[0][0] if self._arrivals else float("inf")

    def advance(self, until: float) -> list[int]:
        self.now = max(self.now, until)
        delivered = []
        while self._arrivals and self._arrivals[0][0] <= self.now:
            delivered.append(heapq.heappop(self._arrivals)[1])
        return delivered

    @property
    def busy(self) -> bool:
        return bool(self._arrivals)
