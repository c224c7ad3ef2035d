"""Flow-level network: messages become flows whose rates are max-min fair over the links they cross.

A message from one accelerator to another becomes one flow (or several, under ecmp_paths) routed
by routing.py. A flow waits out its route's latency, then transfers at a rate set by max-min
fairness over all flows in transfer (Bertsekas & Gallager, "Data Networks", 6.5.2): rates rise
together until some link is full; the flows crossing it are frozen at that rate; the rest keep
rising until every flow crosses a full link. A sprayed flow uses each link in proportion to the
share of it the link carries (weighted progressive filling). Rates are recomputed whenever a flow
starts or ends, the standard flow-level approximation of a packet network (what SimGrid and
ASTRA-sim's analytical backend do): no packets, no queues; only for the flows connected to it
through shared links, since max-min fairness splits over the flow-link graph's components.
`AimdNetwork` replaces the instant max-min rates by a rate-based congestion controller (additive
increase, multiplicative decrease).

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
    route: Route


@dataclass
class FlowNetwork:
    """Flows over `router.topology`; the caller advances time from event to event.

    Flows in transfer live in slots of flat arrays (bytes left, size, rate, message), and the links they
    cross in three parallel arrays (slot, link, weight), so that advancing time, finding the next end and
    recomputing the max-min rates are array operations over all flows at once."""

    router: Router
    now: float = 0.0
    link_bytes: np.ndarray = field(init=False)
    _capacity: np.ndarray = field(init=False)
    _starting: list[tuple[float, int, int]] = field(default_factory=list)  # (time, flow, message)
    _parked: dict[int, _Flow] = field(default_factory=dict)
    _unfinished: dict[int, int] = field(default_factory=dict)  # message -> flows not yet delivered
    _instant: list[tuple[float, int]] = field(default_factory=list)  # (time, message): nothing to transfer
    _next_flow: int = 0
    _next_message: int = 0

    def __post_init__(self) -> None:
        links = self.router.topology.links
        self._capacity = np.array([link.bandwidth for link in links], dtype=float)
        self.link_bytes = np.zeros(len(links))
        self._left = np.zeros(0)
        self._size = np.zeros(0)
        self._rate = np.zeros(0)
        self._message = np.zeros(0, dtype=np.int64)
        self._active = np.zeros(0, dtype=bool)
        self._free: list[int] = []
        self._pair_slot = np.zeros(0, dtype=np.int64)
        self._pair_link = np.zeros(0, dtype=np.int64)
        self._pair_weight = np.zeros(0)
        self._routes: dict[Route, tuple[np.ndarray, np.ndarray]] = {}
        self._next_end = float("inf")  # when the first flow in transfer ends at the current rates
        self._synced = 0.0  # the time bytes left and link counters are accurate at

    def send(self, source: int, destination: int, nbytes: float, key: object = None) -> int:
        """Start a message now; returns its id (reported by `advance` when delivered)."""
        message = self._next_message
        self._next_message += 1
        parts = self.router.split(source, destination, (key, message) if key is None else key)
        self._unfinished[message] = len(parts)
        for part_key, share in parts:
            route = self.router.route(source, destination, part_key)
            start = self.now + self.router.path_latency(route)
            flow = _Flow(message, nbytes * share, route)
            if not route or flow.size <= 0:
                heapq.heappush(self._instant, (start, message))
                continue
            self._parked[self._next_flow] = flow
            heapq.heappush(self._starting, (start, self._next_flow, message))
            self._next_flow += 1
        return message

    # ----------------------------------------------------------------- flows in slots
    def _slot(self) -> int:
        if not self._free:
            old = len(self._left)
            grown = max(16, 2 * old)
            self._left = np.concatenate([self._left, np.zeros(grown - old)])
            self._size = np.concatenate([self._size, np.ones(grown - old)])
            self._rate = np.concatenate([self._rate, np.zeros(grown - old)])
            self._message = np.concatenate([self._message, np.zeros(grown - old, dtype=np.int64)])
            self._active = np.concatenate([self._active, np.zeros(grown - old, dtype=bool)])
            self._free = list(range(grown - 1, old - 1, -1))
        return self._free.pop()

    def _route_arrays(self, route: Route) -> tuple[np.ndarray, np.ndarray]:
        if route not in self._routes:
            self._routes[route] = (np.array([link for link, _ in route], dtype=np.int64),
                                   np.array([weight for _, weight in route], dtype=float))
        return self._routes[route]

    def _start(self, flows: list[_Flow]) -> np.ndarray:
        """Put `flows` in transfer; returns the links they cross."""
        slots, links, weights = [], [], []
        for flow in flows:
            slot = self._slot()
            self._left[slot] = self._size[slot] = flow.size
            self._message[slot] = flow.message
            self._active[slot] = True
            link, weight = self._route_arrays(flow.route)
            slots.append(np.full(len(link), slot, dtype=np.int64))
            links.append(link)
            weights.append(weight)
        self._pair_slot = np.concatenate([self._pair_slot, *slots])
        self._pair_link = np.concatenate([self._pair_link, *links])
        self._pair_weight = np.concatenate([self._pair_weight, *weights])
        return np.concatenate(links) if links else np.zeros(0, dtype=np.int64)

    def _update_rates(self, touched: np.ndarray | None = None) -> None:
        """New max-min rates, and with them the time the first flow in transfer ends (rates hold till then).
        `touched`: the links of the flows that just started or ended; only the flows that share links with them,
        directly or through other flows, can change rate (max-min fairness splits over the connected components
        of the flow-link graph), so only that component is recomputed. None: every flow."""
        self._next_end = float("inf")
        if not len(self._pair_slot):
            self._rate[:] = 0.0
            return
        part = None if touched is None else self._component(touched)
        if part is None or part.all():
            self._rate[:] = max_min_rates(self._pair_slot, self._pair_link, self._pair_weight, self._capacity,
                                          len(self._rate))
        else:
            slots = self._pair_slot[part]
            rates = max_min_rates(slots, self._pair_link[part], self._pair_weight[part], self._capacity, len(self._rate))
            self._rate[slots] = rates[slots]
            self._rate[~self._active] = 0.0
        self._schedule_end()

    def _component(self, touched: np.ndarray) -> np.ndarray:
        """The (slot, link) pairs of every flow connected to the `touched` links through shared links."""
        links = np.zeros(len(self._capacity), dtype=bool)
        links[touched] = True
        flows = np.zeros(len(self._rate), dtype=bool)
        while True:
            flows[self._pair_slot[links[self._pair_link]]] = True
            part = flows[self._pair_slot]
            reached = np.zeros(len(self._capacity), dtype=bool)
            reached[self._pair_link[part]] = True
            if not (reached & ~links).any():
                return part
            links |= reached

    def _schedule_end(self) -> None:
        active = self._active
        end = self.now + float(np.min(self._left[active] / self._rate[active]))
        # a flow ending sooner than the clock can resolve still ends: at the next representable time
        self._next_end = end if end > self.now else float(np.nextafter(self.now, np.inf))

    def next_event(self) -> float:
        """Time of the next flow start, flow end or instant delivery (inf when idle)."""
        return min(self._starting[0][0] if self._starting else float("inf"),
                   self._instant[0][0] if self._instant else float("inf"), self._next_end)

    def _sync(self) -> None:
        """Bring bytes left up to `now` (rates were constant since the last sync). A link's byte counter is added
        to when a flow crossing it ends (its whole size x the link's weight): what it carried."""
        elapsed = self.now - self._synced
        if len(self._pair_slot) and elapsed > 0:
            active = self._active
            self._left[active] -= self._rate[active] * elapsed
        self._synced = self.now

    def advance(self, until: float) -> list[int]:
        """Move time to `until` (at most `next_event()`); returns the messages delivered by then, in order.
        Flows are only touched when one ends or starts: in between, time moves and nothing else does."""
        delivered: list[int] = []
        changed = False
        touched: list[np.ndarray] = []  # the links of the flows that end or start now
        self.now = max(self.now, until)
        starts = bool(self._starting) and self._starting[0][0] <= self.now
        if len(self._pair_slot) and (self.now >= self._next_end or starts):
            self._sync()
            active = self._active
            finished = np.flatnonzero(active & (self._left <= _DONE_RELATIVE * self._size))
            if len(finished):
                self._active[finished] = False
                self._free.extend(finished.tolist())
                keep = self._active[self._pair_slot]
                ended = ~keep
                np.add.at(self.link_bytes, self._pair_link[ended],
                          self._pair_weight[ended] * self._size[self._pair_slot[ended]])
                touched.append(self._pair_link[ended])
                self._pair_slot, self._pair_link = self._pair_slot[keep], self._pair_link[keep]
                self._pair_weight = self._pair_weight[keep]
                for message in self._message[finished].tolist():
                    self._finish(message, delivered)
                changed = True
            elif not starts:  # the first end, rounded: it is still due, a representable instant later
                self._schedule_end()
        else:
            self._synced = self.now if not len(self._pair_slot) else self._synced
        while self._instant and self._instant[0][0] <= self.now:
            self._finish(heapq.heappop(self._instant)[1], delivered)
        starting = []
        while self._starting and self._starting[0][0] <= self.now:
            _, flow_id, _ = heapq.heappop(self._starting)
            starting.append(self._parked.pop(flow_id))
        if starting:
            self._sync()
            touched.append(self._start(starting))
            changed = True
        if changed:
            self._update_rates(np.concatenate(touched))
        return delivered

    def _finish(self, message: int, delivered: list[int]) -> None:
        self._unfinished[message] -= 1
        if not self._unfinished[message]:
            del self._unfinished[message]
            delivered.append(message)

    @property
    def busy(self) -> bool:
        return bool(len(self._pair_slot) or self._starting or self._instant)

    def rates(self) -> dict[int, float]:
        """The current rate (bytes/s) of each message's flows in transfer, summed per message."""
        out: dict[int, float] = {}
        for slot in np.flatnonzero(self._active).tolist():
            message = int(self._message[slot])
            out[message] = out.get(message, 0.0) + float(self._rate[slot])
        return out


def flow_network(router: Router, congestion: str = "none") -> FlowNetwork:
    """The flow-level network with the rate law `congestion` names (CONGESTION in names.py)."""
    from fivefold.errors import ConfigError
    from fivefold.sim.names import CONGESTION

    if congestion not in CONGESTION:
        raise ConfigError(f"--congestion {congestion!r}: use one of {', '.join(CONGESTION)}")
    return AimdNetwork(router) if congestion == "aimd" else FlowNetwork(router)


def max_min_rates(flow_of: np.ndarray, link_of: np.ndarray, weight: np.ndarray, capacity: np.ndarray,
                  flows: int) -> np.ndarray:
    """Weighted max-min fair rates by progressive filling.

    (flow_of[k], link_of[k], weight[k]): flow flow_of[k] puts weight[k] times its rate on link
    link_of[k]. All rates rise together until a link is full; its flows freeze; repeat. Flows that
    appear in no triple keep rate 0.
    """
    remaining = capacity.astype(float)
    full = 1e-12 * capacity
    rates = np.zeros(flows)
    frozen = np.ones(flows, dtype=bool)
    frozen[flow_of] = False
    live = np.ones(len(flow_of), dtype=bool)
    links = len(capacity)
    while live.any():
        slope = np.bincount(link_of[live], weights=weight[live], minlength=links)
        loaded = slope > 0
        headroom = np.full(links, np.inf)
        headroom[loaded] = remaining[loaded] / slope[loaded]
        tightest = int(np.argmin(headroom))
        step = float(headroom[tightest])
        rates[~frozen] += step
        remaining -= step * slope
        saturated = loaded & (remaining <= full)
        saturated[tightest] = True
        frozen[flow_of[live & saturated[link_of]]] = True
        live = ~frozen[flow_of]
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


@dataclass
class AimdNetwork(FlowNetwork):
    """FlowNetwork with rate-based congestion control in place of instant max-min fairness (the AIMD law of
    Chiu and Jain 1989, as rate-based controllers such as DCQCN apply it per flow).

    Each flow sends at its own rate. Every `interval` seconds each flow whose path crossed an overloaded
    link (offered load above capacity) cuts its rate by the factor `decrease`; every other flow adds
    `increase` times its path's slowest link. A link offered more than its capacity delivers it, shared
    in proportion to the offered rates, so a flow gets its rate times its most overloaded link's
    capacity / load. A new flow starts at `decrease` times its path's slowest link. Known behaviours
    (tests/test_simulator.py): one flow alone saws between `decrease` x and 1 x the link, so it averages
    (1 + decrease) / 2 of it; flows sharing a link converge to equal rates."""

    interval: float = 10e-6
    increase: float = 0.01
    decrease: float = 0.5
    _tick: float = field(default=float("inf"), init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value, ok in (("interval", self.interval, self.interval > 0),
                                ("increase", self.increase, 0 < self.increase <= 1),
                                ("decrease", self.decrease, 0 < self.decrease < 1)):
            if not ok:
                raise ValueError(f"AIMD {name} = {value}: interval > 0, 0 < increase <= 1, 0 < decrease < 1")
        self._window = np.zeros(0)  # offered rate per slot
        self._line = np.zeros(0)  # the path's slowest link per slot
        self._new: list[int] = []  # slots taken by the flows `_start` is starting

    def _slot(self) -> int:
        slot = super()._slot()
        if len(self._window) < len(self._left):
            grown = len(self._left) - len(self._window)
            self._window = np.concatenate([self._window, np.zeros(grown)])
            self._line = np.concatenate([self._line, np.zeros(grown)])
        self._new.append(slot)
        return slot

    def _start(self, flows: list[_Flow]) -> np.ndarray:
        self._new = []
        links = super()._start(flows)
        new = np.array(self._new, dtype=np.int64)
        line = np.full(len(self._rate), np.inf)
        np.minimum.at(line, self._pair_slot, self._capacity[self._pair_link] / self._pair_weight)
        self._line[new] = line[new]
        self._window[new] = self.decrease * line[new]
        if self._tick == float("inf"):
            self._tick = self.now + self.interval
        return links

    def _loads(self) -> np.ndarray:
        return np.bincount(self._pair_link, self._pair_weight * self._window[self._pair_slot],
                           minlength=len(self._capacity))

    def _update_rates(self, touched: np.ndarray | None = None) -> None:
        """Each flow's delivered rate: its offered rate, thinned by its most overloaded link (every flow: the
        controller's rates change at every tick)."""
        self._rate[:] = 0.0
        self._next_end = float("inf")
        if len(self._pair_slot):
            load = self._loads()
            share = np.ones(len(load))
            over = load > self._capacity
            share[over] = self._capacity[over] / load[over]
            factor = np.ones(len(self._rate))
            np.minimum.at(factor, self._pair_slot, share[self._pair_link])
            self._rate[:] = np.where(self._active, self._window * factor, 0.0)
            self._schedule_end()

    def next_event(self) -> float:
        return min(super().next_event(), self._tick if len(self._pair_slot) else float("inf"))

    def advance(self, until: float) -> list[int]:
        control = until >= self._tick and len(self._pair_slot) > 0
        delivered = super().advance(until)
        if not len(self._pair_slot):
            self._tick = float("inf")
        elif control:
            self._sync()
            congested = np.zeros(len(self._rate), dtype=bool)
            over = self._loads() > self._capacity * (1 + 1e-9)
            congested[self._pair_slot[over[self._pair_link]]] = True
            active = self._active
            self._window[active & congested] *= self.decrease
            grow = active & ~congested
            self._window[grow] += self.increase * self._line[grow]
            self._tick = self.now + self.interval
            self._update_rates()
        return delivered
