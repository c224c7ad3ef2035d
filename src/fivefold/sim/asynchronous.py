"""Asynchronous parameter servers simulated: the workers' steady state around their servers (asp, ssp).

Under `parameter_server.sync = asp` or `ssp` (parallel/parameter_server.py; SSP: Ho et al. 2013) a server
steps once per push, as each arrives, and answers the pusher's pull at once (ssp: once the pusher is at most
`staleness` steps ahead of the slowest worker). The workers are not in lock step, so one step tells little: the
workload (sim/workload.py) plays `ASYNC_STEPS` steps of every worker and each server's service of all their
pushes. A server receives from whichever worker's push comes first (`dist.recv` from any source), which a
static program cannot say, so each server's order is a fixed point, as the priority schedule's is
(sim/priority.py): simulate with the workers in turn, order the pushes by when the workers posted them
(`arrival_orders`: a worker's own in step order, ties to the lower rank), simulate again in that order, until
the two agree (sim/priority.py `settle`: at most 4 simulations; should they still differ, the last stands).

The step reported is the workers' steady state: per worker, the time from the end of its first step to the end
of its last over the steps between, the slowest worker's; its phases likewise, from snapshots of the worker's
compute stream at each step's end (`SimResult.snapshots`); the bytes per rank pair and link are the run's over
its steps. The first step is left out: every worker starts at once, so its pushes queue at the servers together.
"""

from __future__ import annotations

from fivefold.sim.engine import SNAPSHOT, SimResult
from fivefold.sim.priority import Play, settle
from fivefold.sim.workload import COMPUTE, Workload


def workers_of(workload: Workload) -> list[int]:
    return [rank for rank in workload.simulated if rank not in workload.server_ranks]


def arrival_orders(workload: Workload, result: SimResult) -> dict[int, list[int]]:
    """Each server's pushes in the order the workers posted them in `result` (every worker pushes to every server
    at once, so the servers share the order)."""
    posted = sorted((result.events[(worker, f"s{step}-push")], worker) for worker in workers_of(workload)
                    for step in range(workload.steps))
    order = [worker for _, worker in posted]
    return {server: list(order) for server in workload.server_ranks}


def steady_state(play: Play, workload: Workload, result: SimResult) -> tuple[Workload, SimResult, int]:
    """From a first run (`workload`, `result`): the run whose push orders are its own arrival orders, reported as
    its steady step (see the module docstring), and how many simulations found the orders."""
    workload, result, passes = settle(play, workload, result, arrival_orders, "push_orders")
    return workload, steady_step(result, workload), passes


def steady_step(result: SimResult, workload: Workload) -> SimResult:
    """The workers' mean step after their first, the slowest worker's time (see the module docstring)."""
    steps = workload.steps
    first, last = f"{SNAPSHOT}s0", f"{SNAPSHOT}s{steps - 1}"
    workers = workers_of(workload)
    period = {w: (result.events[(w, last)] - result.events[(w, first)]) / (steps - 1) for w in workers}
    labelled = dict(result.labelled)
    for w in workers:
        before, after = result.snapshots[(w, first)], result.snapshots[(w, last)]
        labelled[(w, COMPUTE)] = {label: (after.get(label, 0.0) - before.get(label, 0.0)) / (steps - 1)
                                  for label in after}
    finish = {key: when / steps for key, when in result.finish.items()}  # servers and other streams: per step
    finish.update({(w, COMPUTE): period[w] for w in workers})
    return SimResult(max(period.values()), finish, {pair: n // steps for pair, n in result.pair_bytes.items()},
                     [n / steps for n in result.link_bytes], result.spans, labelled, result.events, result.snapshots)
