"""The priority schedule's steady-state step, simulated (P3, Jayarajan et al. 2019; ByteScheduler, Peng et al. 2019).

Under `gradient_comm.schedule = priority` (parallel/comm_schedule.py) the runtime's communication thread
reduces, whenever it is free, the most urgent slice (lowest forward position) that is ready on every rank
of its group, and each module's next forward waits only for its own slices. Two things follow that a
one-step program cannot show, and this module supplies both:

- the order depends on time: on when backward completes each bucket and how long each slice takes, which
  are what the simulation computes. So the order is a fixed point: simulate with an order (first
  `first_guess_order`: bucket by bucket), replay the runtime's rule on the simulated times
  (`greedy_order`), simulate again with the order it picks, until the two agree (at most `MAX_PASSES`
  simulations; should the rule's order still differ then, the last one stands);
- a step's gradients are reduced under the next step's forward, so the steady state is the second of two
  steps (sim/workload.py writes two). Its figures are the two-step run's less a one-step run's (the same
  first step): the time from the last rank ending step one to the last ending step two, each compute
  stream's phases, the bytes per rank pair and per link; the trace keeps both steps.
"""

from __future__ import annotations

from collections.abc import Callable

from fivefold.sim.engine import SimResult
from fivefold.sim.workload import COMPUTE, Workload

MAX_PASSES = 4  # simulations while looking for an order (a fixed point is usually the second)

Play = Callable[..., tuple[Workload, SimResult]]  # (slice_order=..., steps=..., push_orders=...) -> workload, run


def settle(play: Play, workload: Workload, result: SimResult, propose: Callable[[Workload, SimResult], object],
           name: str) -> tuple[Workload, SimResult, int]:
    """Simulate again with what `propose` reads off the last run (the workload's field and `play`'s keyword `name`)
    until it is what that run used, at most MAX_PASSES simulations in all (the last stands); and their count."""
    passes = 1
    while passes < MAX_PASSES:
        proposal = propose(workload, result)
        if proposal == getattr(workload, name):
            break
        workload, result = play(**{name: proposal})
        passes += 1
    return workload, result, passes


def greedy_order(workload: Workload, result: SimResult, step: int) -> list[int]:
    """The order the runtime's rule picks given the simulated times of `step`: a bucket's slices are ready when
    the last simulated rank has completed it; each slice takes what it took in the simulation (from the last
    rank reaching it to the last finishing it); whenever the thread is free it takes the ready slice of lowest
    forward position, else waits for the next bucket."""
    slices = workload.slices
    if not slices:
        return []

    def latest(event: str) -> float:
        return max(result.events[(rank, event)] for rank in workload.simulated if (rank, event) in result.events)

    ready = {b: latest(f"s{step}-ready{b}") for b in {piece.bucket for piece in slices}}
    took = [max(0.0, latest(f"s{step}-slice{k}") - latest(f"s{step}-begin{k}")) for k in range(len(slices))]
    left, order = set(range(len(slices))), []
    now = min(ready.values())
    while left:
        waiting = [k for k in left if ready[slices[k].bucket] <= now]
        if not waiting:
            now = min(ready[slices[k].bucket] for k in left)
            continue
        k = min(waiting, key=lambda k: (slices[k].priority, k))
        order.append(k)
        left.remove(k)
        now += took[k]
    return order


def steady_state(play: Play, workload: Workload, result: SimResult) -> tuple[Workload, SimResult, int]:
    """From a first two-step run (`workload`, `result`): the run whose slice order the runtime's rule reproduces,
    reported as its second step (see the module docstring), and how many simulations found the order."""
    workload, result, passes = settle(play, workload, result, lambda w, r: greedy_order(w, r, w.steps - 1), "slice_order")
    _, first = play(slice_order=workload.slice_order, steps=workload.steps - 1)
    return workload, second_step(result, first, workload), passes


def second_step(both: SimResult, first: SimResult, workload: Workload) -> SimResult:
    """`both` (two steps) less `first` (the first alone): the second step's time, finish times (from the end of the
    first), phases, and bytes."""
    ranks = workload.simulated
    end = max(first.finish.get((rank, COMPUTE), 0.0) for rank in ranks)
    time = max(both.finish.get((rank, COMPUTE), 0.0) for rank in ranks) - end
    labelled = {key: {label: seconds - first.labelled.get(key, {}).get(label, 0.0) for label, seconds in totals.items()}
                for key, totals in both.labelled.items()}
    pairs = {pair: nbytes - first.pair_bytes.get(pair, 0) for pair, nbytes in both.pair_bytes.items()}
    links = [a - b for a, b in zip(both.link_bytes, first.link_bytes)]
    return SimResult(time, {key: max(0.0, when - end) for key, when in both.finish.items()},
                     {pair: n for pair, n in pairs.items() if n}, links, both.spans, labelled, both.events)
