"""Arrival skew at sync points (plan/cluster.py ArrivalSpec): the cluster file's [arrival] table, the
planner's waits per block pass (plan/estimate.py block_sync_waits) and the simulator's at its sync points
(sim/workload.py Workload.arrive, sim/engine.py Delay), each checked by hand."""

from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest

from fivefold.config import load_config
from fivefold.errors import ConfigError
from fivefold.parallel.pipeline.simulate import CoreSharing
from fivefold.plan.cluster import PRESETS, ArrivalSpec, cluster_from_dict, cluster_toml, expected_latest
from fivefold.plan.estimate import block_sync_points, degrees_of, estimate, model_for, pass_costs
from fivefold.sim.cores import SharedCores
from fivefold.sim.engine import Collective, Compute, Delay, Wait, simulate
from fivefold.sim.network import DedicatedNetwork
from fivefold.sim.routing import Router
from fivefold.sim.step import simulate_step
from fivefold.sim.topology import nvswitch
from fivefold.sim.workload import COMPUTE, build_workload

H100 = PRESETS["h100-sxm"]
SMALL = ["--train.seq_len", "128", "--train.micro_batch_size", "2", "--model.n_layers", "4"]
# a tiny all-reduce's microseconds after microseconds of compute: a straight line of slope 0.1 from 2 ms on
CURVE = ArrivalSpec(after_us=2000.0, measured=((0.0, 500.0), (2000.0, 500.0), (22000.0, 2500.0)), ranks=2)
# H100's tiny-model passes last microseconds: at 0.05 TFLOP/s they last milliseconds, long enough to skew
SLOW = dataclasses.replace(H100, accelerator=dataclasses.replace(H100.accelerator, tflops={"fp32": 0.05, "bf16": 0.05}))


def _config(*overrides: str):
    return load_config("configs/tiny.toml", [*SMALL, *overrides])


def _skewed(cluster=H100, arrival=CURVE):
    return dataclasses.replace(cluster, arrival=arrival)


def test_expected_latest_of_normal_arrivals():
    # closed forms: E[max] of 2 and 3 standard normals are 1/sqrt(pi) and 3/(2 sqrt(pi))
    assert expected_latest(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_latest(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    assert expected_latest(1) == pytest.approx(0.0, abs=1e-9)
    assert expected_latest(4) == pytest.approx(1.0294, abs=1e-4)


def test_sync_delay_is_the_measured_rise_past_the_collectives_burst():
    c = _skewed()
    assert c.sync_delay(0.0, 2) == 0.0 and c.sync_delay(0.002, 2) == 0.0  # the collectives already hold 2 ms's
    assert c.sync_delay(0.012, 2) == pytest.approx(1e-3)  # (12 - 2) ms x 0.1
    assert c.sync_delay(0.5, 2) == pytest.approx(2e-3)  # flat past the last point
    assert c.sync_delay(0.012, 1) == 0.0  # one rank waits for nobody
    # measured over 2 ranks: a group of 4 waits for the latest of four
    assert c.sync_delay(0.012, 4) == pytest.approx(1e-3 * expected_latest(4) / expected_latest(2))
    assert H100.sync_delay(0.012, 2) == 0.0  # no [arrival]: no skew (the GPU presets)
    # a noisy dip (5 ms slower than 10 ms) is read through the least-squares nondecreasing fit, as the collectives'
    # times are: the two points at their mean, 800 us, so the wait never shrinks with compute
    dip = _skewed(arrival=ArrivalSpec(2000.0, ((2000.0, 500.0), (5000.0, 900.0), (10000.0, 700.0), (20000.0, 1500.0)), 2))
    assert dip.sync_delay(0.005, 2) == pytest.approx(300e-6) and dip.sync_delay(0.010, 2) == pytest.approx(300e-6)
    assert dip.sync_delay(0.015, 2) == pytest.approx((800 + 350 - 500) * 1e-6)


def test_arrival_table_round_trips_and_bad_tables_are_refused():
    c = _skewed()
    assert cluster_from_dict(tomllib.loads(cluster_toml(c))).arrival == CURVE
    assert cluster_from_dict(c.to_dict()) == c  # the Python dict too (its topology.torus is a tuple)
    assert "[arrival]" not in cluster_toml(H100)
    data = tomllib.loads(cluster_toml(c))
    for bad in ({"measured": [[0, 1]]}, {"measured": [[5, 1], [2, 1]], "ranks": 2}, {"measured": [[0, 1], [5, -1]]},
                {"measured": [[0, 1], [5, 1]], "ranks": 1}, {"measured": [[0, 1], [5, 1]], "after": 3},
                {"measured": [[0, 1, 2], [5, 1]]}, {"after_us": 5}):
        with pytest.raises(ConfigError, match="arrival"):
            cluster_from_dict(data | {"arrival": bad})


def test_planner_adds_one_wait_per_sync_point_of_each_block_pass():
    """tp 2 (dense blocks): two regions, so two sync points per pass, each after half the pass's compute;
    backward's pass is twice the forward's. cp 2 (ring): one per pass. dp 2: none. By hand from the curve."""
    for options, points in ((("--tensor_parallel.degree", "2"), (2, 0, 0)),
                            (("--context_parallel.degree", "2"), (0, 1, 0)),
                            (("--tensor_parallel.degree", "2", "--context_parallel.degree", "2"), (2, 1, 0)),
                            ((), (0, 0, 0))):
        config = _config(*options)
        gpus = math.prod(int(v) for v in options[1::2]) if options else 2
        d = degrees_of(config, gpus)
        model = model_for(config, 257)
        assert block_sync_points(config, d, False) == points
        block = pass_costs(config, model, d, SLOW, 0.5).block[False]
        n = max(sum(points), 1)
        # per fold: its sync points x (the forward's wait + the backward's), every layer
        by_hand = [model.n_layers * k * (_skewed(SLOW).sync_delay(block / n, 2)
                                         + _skewed(SLOW).sync_delay(2 * block / n, 2)) for k in points]
        skew = estimate(config, gpus, _skewed(SLOW), 0.5, vocab_size=257).time
        plain = estimate(config, gpus, SLOW, 0.5, vocab_size=257).time
        assert skew.total - plain.total == pytest.approx(sum(by_hand), rel=1e-9, abs=1e-12), options
        assert (skew.tp - plain.tp, skew.cp - plain.cp) == pytest.approx(by_hand[:2], abs=1e-12)
        assert (sum(by_hand) > 0) == (sum(points) > 0)
        noted = any("arrival skew" in note for note in estimate(config, gpus, _skewed(SLOW), 0.5, vocab_size=257).notes)
        assert noted == (sum(points) > 0)  # `fivefold plan` says so where it applies
        assert not any("arrival" in note for note in estimate(config, gpus, SLOW, 0.5, vocab_size=257).notes)
    # sequence parallelism's all-gather follows the previous reduce-scatter: still two per pass; overlapped
    # rings hide their waits; a MoE block with expert parallelism blocks twice (dispatch, combine)
    sp = _config("--tensor_parallel.degree", "2", "--tensor_parallel.sequence_parallel", "true")
    assert block_sync_points(sp, degrees_of(sp, 2), False) == (2, 0, 0)
    overlap = _config("--tensor_parallel.degree", "2", "--tensor_parallel.sequence_parallel", "true",
                      "--tensor_parallel.comm_overlap", "true")
    assert block_sync_points(overlap, degrees_of(overlap, 2), False) == (0, 0, 0)
    moe = _config("--model.preset", "tiny-moe", "--expert_parallel.degree", "2")
    assert block_sync_points(moe, degrees_of(moe, 2), True) == (0, 0, 2)
    assert block_sync_points(moe, degrees_of(moe, 2), False) == (0, 0, 0)


def test_simulator_waits_the_skew_of_the_compute_before_each_sync_point():
    """Walking a tp 2 x cp 2 rank's compute stream: every Delay is the curve's wait for the compute since the
    previous sync point (a collective, a message wait or a delay), over the sync's group; dp 2 has none."""
    slow = SLOW
    cluster = _skewed(slow, ArrivalSpec(0.0, ((0.0, 0.0), (20000.0, 2000.0)), 2))  # rising from no compute on
    config = _config("--tensor_parallel.degree", "2", "--context_parallel.degree", "2")
    workload = build_workload(config, 4, cluster, 0.5, "flow", 257)
    since, delays = 0.0, []
    for op in workload.programs[(0, COMPUTE)]:
        if isinstance(op, Compute):
            since += op.seconds
        elif isinstance(op, Delay):
            assert op.label in ("tp", "cp", "ep")
            assert op.seconds == pytest.approx(cluster.sync_delay(since, 2))
            delays.append(op.seconds)
            since = 0.0
        elif isinstance(op, (Collective, Wait)):
            since = 0.0
    assert len(delays) >= 2 * 4 * 3  # at least one per sync point the planner counts, forward and backward
    skewed = simulate_step(config, 4, cluster, 0.5, vocab_size=257)
    plain = simulate_step(config, 4, slow, 0.5, vocab_size=257)
    assert skewed.time - plain.time == pytest.approx(sum(delays), rel=0.05)
    planned = estimate(config, 4, cluster, 0.5, vocab_size=257).time.total - estimate(config, 4, slow, 0.5,
                                                                                       vocab_size=257).time.total
    assert skewed.time - plain.time == pytest.approx(planned, rel=0.1)  # the planner's even-split rule
    dp = _config()
    assert not any(isinstance(op, Delay) for op in build_workload(dp, 2, cluster, 0.5, "flow", 257).programs[(0, COMPUTE)])


def test_a_delay_waits_off_the_shared_cores():
    """Two ranks on one core: rank 0 waits 1 s (a Delay), rank 1 computes 1 s of work priced with both
    computing, so alone it takes half that; were the delay compute, both would end at 1 s."""
    programs = {(0, "compute"): [Delay(1.0, "tp")], (1, "compute"): [Compute(1.0)]}
    cores = SharedCores(CoreSharing(cores=1, efficiency=1.0), ranks=2)
    result = simulate(programs, DedicatedNetwork(Router(nvswitch(2, 1e9, 0.0))), True, cores, frozenset(programs))
    assert result.finish[(1, "compute")] == pytest.approx(0.5)
    assert result.finish[(0, "compute")] == pytest.approx(1.0)
    assert result.labelled[(0, "compute")] == {"tp": pytest.approx(1.0)}
