"""Pipeline schedules, run together in the pure-Python simulator: complete, deadlock-free, in order,
with the bubble the papers give and the expected peak of in-flight micro-batches."""

from __future__ import annotations

from collections import Counter

import pytest

from fivefold.parallel.pipeline.schedules import (
    Instruction,
    Op,
    PipelineShape,
    all_schedules,
    check_schedule,
    ideal_bubble,
)
from fivefold.parallel.pipeline.simulate import Costs, CoreSharing, ScheduleError, simulate

SHAPES = [(2, 4), (3, 6), (4, 8), (4, 16)]  # (p, m)


def _costs(name: str, virtual: int) -> Costs:
    # Equal stage costs: F = 1, B = 2 per whole stage, split into I = W = 1 for zero bubble;
    # a virtual stage holds 1/v of a rank's layers, so its passes take 1/v as long.
    return Costs(forward=1 / virtual, backward=2 / virtual, backward_input=1, backward_weight=1)


CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for p, m in SHAPES] + [
    ("interleaved", p, m, v) for p, m in SHAPES for v in (2, 3)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_is_complete_deadlock_free_and_has_the_papers_bubble(name, p, m, v):
    shape = PipelineShape(p, m, v)
    streams = all_schedules(name, shape)
    sim = simulate(streams, _costs(name, v))  # raises on deadlock or out-of-order messages

    # Every (micro-batch, stage) is computed forward and backward exactly once, on its own rank.
    split = name == "zb-h1"
    wanted = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if split else (Op.FORWARD, Op.BACKWARD)
    done = Counter((i.op, i.microbatch, i.stage) for s in streams.values() for i in s if i.op in wanted)
    assert done == Counter({(op, mb, st): 1 for op in wanted for mb in range(m) for st in range(shape.stages)})
    for rank, stream in streams.items():
        assert all(shape.rank_of(i.stage) == rank for i in stream if i.op in wanted)
        assert stream[-2:] == [Instruction(Op.REDUCE_GRADS), Instruction(Op.OPTIMIZER_STEP)]

    assert sim.bubble_over_ideal == pytest.approx(ideal_bubble(name, shape))
    assert sim.bubble_fraction == pytest.approx(ideal_bubble(name, shape) / (1 + ideal_bubble(name, shape)))

    peak = sim.peak_in_flight
    if name == "gpipe":
        assert all(peak[r] == m for r in range(p))
    elif name in ("1f1b", "zb-h1"):  # at most p: rank r holds p - r
        assert all(peak[r] == min(p - r, m) for r in range(p))
        if name == "zb-h1":  # and the weight-gradient state waiting is bounded too
            assert all(sim.peak_pending_weight[r] <= 2 * p - r - 1 for r in range(p))
    else:  # interleaved counts chunk activations (each 1/v of a stage's): Megatron's warm-up bound + 1
        assert all(peak[r] == min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p))


def test_ranks_sharing_one_core_lend_it_in_their_bubble():
    """Processor sharing, by hand: two pipeline ranks on one core, so a pass given 1 (the time with both
    computing) takes 1/2 while the other rank idles. GPipe with one micro-batch runs one pass at a time:
    F 1/2 + F 1/2 + B 1 + B 1 = 3, half the 6 of ranks with a core each."""
    streams = all_schedules("gpipe", PipelineShape(2, 1))
    alone = simulate(streams, Costs())
    shared = simulate(streams, Costs(sharing=CoreSharing(cores=1)))
    assert alone.makespan == 6 and shared.makespan == pytest.approx(3.0)
    assert sum(shared.busy.values()) == pytest.approx(3.0) and sum(shared.work.values()) == 6
    assert [(r, ins.op, start, end) for r, ins, start, end in shared.timeline] == pytest.approx(
        [(0, Op.FORWARD, 0.0, 0.5), (1, Op.FORWARD, 0.5, 1.0), (1, Op.BACKWARD, 1.0, 2.0), (0, Op.BACKWARD, 2.0, 3.0)])
    # four pipeline ranks, one thread each, on two cores: alone a rank has a core (twice its shared rate),
    # beside two others 2/3 of one; with two copies of each pipeline rank (dp 2) one rank computing is
    # two threads on two cores, four times the rate of all eight sharing them; four cores: nothing to lend
    assert CoreSharing(cores=2).speed(1, 4) == 2 and CoreSharing(cores=2).speed(3, 4) == pytest.approx(4 / 3)
    assert CoreSharing(cores=2, replicas=2).speed(1, 4) == 4 and CoreSharing(cores=4).speed(1, 4) == 1
    # a host that loses half its throughput to time-slicing: two ranks on their own cores run 4x the rate of
    # all four sharing them; three computing still time-slice, at 4/3
    assert CoreSharing(cores=2, efficiency=0.5).speed(2, 4) == 4
    assert CoreSharing(cores=2, efficiency=0.5).speed(3, 4) == pytest.approx(4 / 3)
    # two ranks on their own cores, a gradient codec's thread computing beside both (sim/workload.py codec_work):
    # four threads on two cores, each at half its rate (times the host's time-slicing efficiency)
    assert CoreSharing(cores=2).speed(2, 2) == 1 and CoreSharing(cores=2).speed(4, 2) == 0.5
    assert CoreSharing(cores=2, efficiency=0.8).speed(3, 2) == pytest.approx(2 / 3 * 0.8)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_shared_cores_conserve_the_work_and_keep_the_order(name, p, m, v):
    """With one core for all p ranks some rank always computes (no latency), so the core never idles and
    the step takes exactly the total work over p; with a core per rank thread nobody speeds up and the
    simulation is the plain one. Either way each rank runs its passes in the same order, holding the same
    micro-batches at its peak."""
    streams = all_schedules(name, PipelineShape(p, m, v))
    costs = _costs(name, v)
    plain = simulate(streams, costs)
    one_core = simulate(streams, Costs(**{**costs.__dict__, "sharing": CoreSharing(cores=1)}))
    assert one_core.makespan == pytest.approx(sum(plain.busy.values()) / p, rel=1e-9)
    assert one_core.peak_in_flight == plain.peak_in_flight
    assert [(r, i) for r, i, _, _ in one_core.timeline if r == 0] == [(r, i) for r, i, _, _ in plain.timeline if r == 0]
    roomy = simulate(streams, Costs(**{**costs.__dict__, "sharing": CoreSharing(cores=2 * p, replicas=2, threads=1)}))
    assert roomy.makespan == pytest.approx(plain.makespan, rel=1e-12) and roomy.busy == pytest.approx(plain.busy)


def test_ideal_bubble_formulas():
    shape = PipelineShape(4, 8, 2)
    assert ideal_bubble("gpipe", PipelineShape(4, 8)) == ideal_bubble("1f1b", PipelineShape(4, 8)) == 3 / 8
    assert ideal_bubble("interleaved", shape) == 3 / 16
    assert ideal_bubble("zb-h1", PipelineShape(4, 8)) == 3 / 24


def test_simulator_rejects_out_of_order_messages_and_deadlocks():
    shape = PipelineShape(2, 2)
    streams = all_schedules("gpipe", shape)
    receiver = streams[1]
    first, second = (k for k, i in enumerate(receiver) if i.op == Op.RECV_ACT)
    receiver[first], receiver[second] = receiver[second], receiver[first]
    with pytest.raises(ScheduleError, match="expects"):
        simulate(streams)

    both_wait = {0: [Instruction(Op.RECV_GRAD, 0, 0, 1), Instruction(Op.SEND_ACT, 0, 0, 1)],
                 1: [Instruction(Op.RECV_ACT, 0, 1, 0), Instruction(Op.SEND_GRAD, 0, 1, 0)]}
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(both_wait)


@pytest.mark.parametrize("name,shape,message", [
    ("interleaved", PipelineShape(4, 6, 2), "multiple of pp"),
    ("interleaved", PipelineShape(4, 8, 1), "at least 2 virtual stages"),
    ("1f1b", PipelineShape(4, 8, 2), "one stage per rank"),
    ("pipedream", PipelineShape(4, 8), "not one of"),
])
def test_bad_schedule_settings_are_named(name, shape, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(name, shape)
