"""`fivefold bench comm`: every collective and algorithm measured beside its prediction, nccl-tests columns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fivefold.comm.bench import (ALGORITHMS, bus_factor, matmul_size, optimizer_constants, oversubscribed_share,
                                 parse_bytes, ranks_fitting, sizes_between)
from fivefold.comm.cost import native_collective, nondecreasing


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 8) == 1.0
    assert parse_bytes("16M") == 16 << 20 and parse_bytes("1K") == 1024 and parse_bytes("512") == 512
    assert sizes_between(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    # 4 one-thread ranks on 2 cores, each at 0.03 while all compute, 0.12 when only 2 do: 0.12 / 0.24 of the throughput
    assert ranks_fitting(2, 1) == 2 and ranks_fitting(2, 4) == 1
    assert oversubscribed_share(4, 0.03, 2, 0.12) == pytest.approx(0.5) and oversubscribed_share(4, 0.1, 2, 0.1) == 1.0


def test_the_matmul_rates_are_timed_where_the_backend_spreads_them_over_the_threads():
    """fp32 on 512 x 512; bf16 on 2048 x 2048 (oneDNN ran a 512 bf16 matmul on one thread on an AMX Xeon), unless
    one such call would take over half the timing: an AVX2 CPU emulates bf16, 0.2 s a 512 call (14 s at 2048)."""
    assert matmul_size("fp32", 0.5, 0.5) == 512
    assert matmul_size("bf16", 0.23e-3, 0.2) == 2048  # AMX: 15 ms a 2048 call
    assert matmul_size("bf16", 0.22, 0.5) == 512
    assert matmul_size("bf16", 2e-3, 0.2) == 512 and matmul_size("bf16", 1e-3, 0.2) == 2048  # 128 and 64 ms a call


def test_optimizer_constants_recover_the_rate_and_the_cost_per_tensor():
    """AdamW timed over 2M parameters in 16 and in 512 tensors, each step 2.8 ns per parameter + 20 us per tensor:
    10 GB/s of 28 bytes per parameter and 20 us per tensor back (also from unequal parameter counts); a faster
    step with more tensors (noise) gives no cost per tensor; two timings with the same ratio cannot be solved."""
    def step(params, tensors):
        return params * 2.8e-9 + tensors * 20e-6

    for a, b in (((1 << 21, 16), (1 << 21, 512)), ((1 << 21, 16), (1 << 20, 1024))):
        gbs, us = optimizer_constants(*a, step(*a), *b, step(*b))
        assert gbs == pytest.approx(10.0) and us == pytest.approx(20.0)
    gbs, us = optimizer_constants(1 << 21, 16, 0.01, 1 << 21, 512, 0.009)
    assert us == 0 and gbs == pytest.approx(28 * (1 << 21) / 0.01 / 1e9)
    with pytest.raises(ValueError, match="cannot separate"):
        optimizer_constants(1000, 10, 1.0, 2000, 20, 2.0)


@pytest.mark.parametrize("world_size", [3])
def test_bench_comm_table_and_json(tmp_path, world_size):
    out = tmp_path / "comm.json"
    run = subprocess.run([sys.executable, "-m", "fivefold", "bench", "comm", f"--nproc-per-node={world_size}",
                          "--min-bytes=1K", "--max-bytes=4K", "--iters=3", "--warmup=1", f"--json={out}",
                          f"--cluster-file={tmp_path / 'here.toml'}"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stderr, run.stderr[-3000:]  # no FutureWarning (or any other) for a user to puzzle over
    assert "busbw(GB/s)" in run.stdout and "meas/pred" in run.stdout and "sent(B)" in run.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == world_size and report["backend"] == "gloo"
    seen = {(r["collective"], r["algorithm"]) for r in report["rows"]}
    assert seen == {(c, a) for c, names in ALGORITHMS.items() for a in names}
    for row in report["rows"]:
        assert row["count"] % world_size == 0 and row["size"] == 4 * row["count"]
        assert row["algbw_gbs"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * bus_factor(row["collective"], world_size))
        assert (row["predicted_us"] is None) == (row["algorithm"] == "native")
        if row["predicted_us"]:
            assert row["predicted_us"] > 0
            assert row["measured_over_predicted"] == pytest.approx(row["time_us"] / row["predicted_us"])
    # the cost model's bytes against the bytes the busiest rank really sent (counted at isend)
    checked = [r for r in report["rows"] if r["predicted_bytes"] is not None]
    assert {(r["collective"], r["algorithm"]) for r in checked} >= {("all_reduce", a) for a in
                                                                     ("ring", "halving_doubling", "rabenseifner", "tree")}
    for row in checked:
        assert row["sent_bytes"] == pytest.approx(row["predicted_bytes"]), (row["collective"], row["algorithm"], row["size"])
    # this machine as a planner cluster file: the fitted links and the timed matmul rates, read back by the planner
    from fivefold.plan.cluster import load_cluster

    here = load_cluster(str(tmp_path / "here.toml"))
    intra = report["links"]["intra"]
    assert here.accelerators_per_node == report["node_size"]
    assert here.intra.latency_us == pytest.approx(intra["alpha"] * 1e6)
    assert here.intra.bandwidth_gbs == pytest.approx(1 / intra["beta"] / 1e9)
    assert here.accelerator.tflops == report["matmul_tflops"] and here.accelerator.peak_flops("fp32") > 0
    assert here.accelerator.memory_bandwidth_gbs == report["memory_gbs"] > 0
    # the runtime's AdamW timed on every rank: its rate per parameter and its cost per tensor
    assert here.accelerator.optimizer_gbs == report["optimizer_gbs"] > 0
    assert here.accelerator.optimizer_tensor_us == report["optimizer_tensor_us"] >= 0
    assert "AdamW step:" in run.stdout
    # the runtime's gradient codecs' local work, each on a one-rank group: ns per value, compression within it
    assert set(here.accelerator.codec_ns) == {"int8", "sign", "topk", "powersgd"} == set(report["codec_ns"])
    assert set(here.accelerator.codec_encode_ns) == {"int8", "sign"}
    assert all(0 < here.accelerator.codec_encode_ns[name] < here.accelerator.codec_ns[name] for name in ("int8", "sign"))
    assert "codecs' local work" in run.stdout
    # the ranks share this host's cores; 3 ranks' threads on 2 cores time-slice, at a measured efficiency
    from fivefold.train.setup import available_cores

    assert here.accelerator.shared_cores == available_cores()
    assert here.accelerator.oversubscribed_efficiency == report["oversubscribed_efficiency"]
    assert 0 < report["oversubscribed_efficiency"] <= 1
    if world_size <= available_cores():  # each rank's thread has a core: nothing is measured
        assert report["oversubscribed_efficiency"] == 1.0
    # each backend collective's own fitted link (two sizes were timed), carried into the cluster file
    assert set(report["native_links"]) == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}
    for name, link in report["native_links"].items():  # fitted to the table's times (back to back)
        timed = sorted((r["size"], r["time_us"]) for r in report["rows"] if r["collective"] == name and r["algorithm"] == "native")
        assert [x for point in link["measured"] for x in point] == pytest.approx([x for s, us in timed for x in (s, us * 1e-6)])
    # the cluster file's: timed again, each call after a burst of compute (as a step makes them), and read back
    assert set(report["native_links_beside_compute"]) == set(report["native_links"])
    for name, link in report["native_links_beside_compute"].items():
        assert here.collectives[name].bandwidth_gbs == pytest.approx(1 / max(link["beta"], 1e-30) / 1e9)
        assert here.collective_link(name, world_size).alpha == pytest.approx(max(link["alpha"], 0.0))
        # and the times it was fitted to, which the planner reads at this world size instead of the line
        assert here.collectives[name].ranks == world_size and len(link["measured"]) >= 2
        assert [x for point in here.collectives[name].measured for x in point] == \
            pytest.approx([x for size, seconds in link["measured"] for x in (size, seconds * 1e6)])
        # read nondecreasing in size (a mean that met a stall is pooled with its neighbours)
        for size, seconds in nondecreasing(tuple(tuple(point) for point in link["measured"])):
            assert native_collective(name, size, world_size, here.collective_link(name, world_size)) == pytest.approx(seconds)
    assert "native all_reduce fitted" in run.stdout
    # the ranks' arrival skew: a tiny all-reduce after 0-20 ms of compute, carried into the file's [arrival]
    arrival = report["arrival"]
    assert arrival["ranks"] == world_size and arrival["after_us"] == 2000.0
    assert [c for c, _ in arrival["measured"]] == [0.0, 500.0, 2000.0, 5000.0, 10000.0, 20000.0]
    assert all(t > 0 for _, t in arrival["measured"])
    assert here.arrival.ranks == world_size and here.arrival.after_us == 2000.0
    assert [x for point in here.arrival.measured for x in point] == \
        pytest.approx([x for point in arrival["measured"] for x in point])
    # 20 ms of compute against 2 ms, read through the least-squares nondecreasing fit (a dip is a noisy mean, pooled with the points it undercuts,
    # as ArrivalSpec.at reads it; a running maximum, which this check used, differs whenever the means dip)
    fitted = nondecreasing(tuple(tuple(point) for point in arrival["measured"]))
    assert here.sync_delay(0.02, world_size) == pytest.approx(max(0.0, fitted[-1][1] - fitted[2][1]) * 1e-6)
    # a ring exchange posted on the rank's own thread beside compute: the line through its times, in the accelerator
    post = report["post"]
    assert [size for size, _ in post["measured"]] == [16384.0, 262144.0, 1048576.0, 4194304.0]
    assert all(t > 0 for _, t in post["measured"]) and post["p2p_post_us"] >= 0 and post["p2p_post_gbs"] >= 0
    assert (here.accelerator.p2p_post_us, here.accelerator.p2p_post_gbs) == (post["p2p_post_us"], post["p2p_post_gbs"])
    assert here.accelerator.post_seconds(1 << 20) > 0 and "ring exchange posted" in run.stdout
    # ring attention's own Python per ring step (plan/ring_host.py), the ranks' mean, in the accelerator
    ring = report["ring_host"]
    assert [row[0] for row in ring["measured"]] == [2, 4] and ring["ring_step_operators"] > 0
    assert here.accelerator.ring_step_operators == ring["ring_step_operators"] and "ring attention's own Python" in run.stdout
    # the grouped GEMM's fixed cost per expert and call (plan/expert_host.py), the ranks' mean, in the accelerator
    groups = report["expert_groups"]
    assert [row[0] for row in groups["measured"]] == [1, 8] and groups["expert_group_us"] > 0
    assert here.accelerator.expert_group_us == groups["expert_group_us"] and "grouped GEMM's fixed cost" in run.stdout
    assert "arrival skew" in run.stdout


def test_the_equal_work_matmul_rate_sizes_its_work_from_the_rate_given(monkeypatch):
    """`matmul_tflops_together` runs on every rank the matmuls `rate` does in about `seconds`, from a barrier to the
    last rank's end, and gives the FLOPs of those calls over that wall time (a one-rank gloo group; a clock that
    reads 0.5 s between the barriers): 0.1 TFLOP/s for 0.2 s is 75 calls of a 512 x 512 matmul."""
    import torch
    import torch.distributed as dist

    from fivefold.comm import bench

    ticks = iter([10.0, 10.5])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rate = bench.matmul_tflops_together("fp32", torch.device("cpu"), rate=0.1, seconds=0.2)
    finally:
        dist.destroy_process_group()
    assert rate == pytest.approx(2 * 512**3 * 75 / 0.5 / 1e12)
