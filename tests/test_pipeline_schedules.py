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
from fivefold.parallel.pipeline.simulate import Costs, ScheduleError, simulate

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
