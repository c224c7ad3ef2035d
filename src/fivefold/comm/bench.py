"""`fivefold bench comm`: an nccl-tests-style benchmark of every hand-written collective and the backend's own.

For each collective, algorithm and message size it reports, as nccl-tests does: size (bytes of
one rank's vector), count (elements), time per call (the slowest rank's, averaged over the
iterations), algbw = size / time, busbw = algbw x the nccl-tests bus factor (all-reduce 2(p-1)/p;
reduce-scatter, all-gather and all-to-all (p-1)/p; broadcast 1), so busbw is comparable with the
link's bandwidth whatever p is. Beside each measured time stands the alpha-beta-gamma prediction
(comm/cost.py) from links fitted by ping-pong on this machine at the start (comm/measure.py),
and their ratio. Rank 0 prints the table and writes JSON with `--json`. `--cluster-file F` also
times a matmul (fp32 and bf16), an add, the runtime's AdamW step (`optimizer_rate`) and its gradient
codecs' local work (`codec_rates`) on every rank at once (the rates a rank achieves while the others
compute too) and writes this machine as a planner cluster file (plan/cluster.py) with the fitted links
and each backend collective's times (over the world and, on more than two ranks, over each smaller group size
dividing it, every group at once: the file's `subgroups`) and the link its ring form runs at (cost.fit_native_link), timed
again each after a burst of compute, as a training step calls them (`time_beside_compute`: on a shared
CPU a call beside compute takes 2-3x its time back to back): the planner prices that collective on it.
It also times a 4-byte all-reduce after bursts of 0 to 20 ms of compute (`measure_arrival`): how far
apart the ranks reach a sync point after that much compute, the file's [arrival]; and the time a rank's
thread spends posting a ring exchange (a send and a receive in one batch_isend_irecv) beside compute
(`measure_post`), the accelerator's p2p_post_us and p2p_post_gbs; ring attention's own Python per ring step
(plan/ring_host.py), the accelerator's ring_step_operators; and the grouped GEMM's fixed cost per expert
(plan/expert_host.py), the accelerator's expert_group_us.

Run under torchrun (`fivefold bench comm --nproc-per-node 4` starts it); gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fivefold.comm import ALL_REDUCE, all_reduce, default_node_size
from fivefold.comm.alltoall import pairwise_all_to_all
from fivefold.comm.cost import (NATIVE_COLLECTIVES, Link, bus_factor, fit_link, fit_native_link, predict_collective,
                                traffic)
from fivefold.comm.measure import measure_cluster
from fivefold.comm.native import all_gather_flat, reduce_scatter_flat
from fivefold.comm.p2p import Ranks
from fivefold.comm.recursive import recursive_all_gather, recursive_reduce_scatter
from fivefold.comm.ring import ring_all_gather, ring_reduce_scatter
from fivefold.comm.tree import binomial_broadcast, chain_broadcast
from fivefold.errors import ConfigError
from fivefold.train.setup import available_cores
from fivefold.units import parse_bytes

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
ALGORITHMS = {
    "all_reduce": ("native", *ALL_REDUCE),
    "reduce_scatter": ("native", "ring", "recursive"),
    "all_gather": ("native", "ring", "recursive"),
    "broadcast": ("native", "binomial", "chain"),
    "all_to_all": ("native", "pairwise"),
}


@dataclass
class Row:
    collective: str
    algorithm: str
    size: int  # bytes of one rank's vector
    count: int
    dtype: str
    time_us: float
    algbw_gbs: float
    busbw_gbs: float
    predicted_us: float | None
    sent_bytes: int | None = None  # bytes the busiest rank sent in one call, counted at isend
    predicted_bytes: float | None = None  # the cost model's count for the busiest rank (cost.traffic)

    @property
    def ratio(self) -> float | None:
        return self.time_us / self.predicted_us if self.predicted_us else None


def operation(collective: str, algorithm: str, x: torch.Tensor, ranks: Ranks, node_size: int):
    """A zero-argument callable running one collective on x (in place where the collective allows), over `ranks`
    (the backend's own over their process group: the world's unless `ranks.group` names one)."""
    p, group = ranks.size, ranks.group
    if collective == "all_reduce":
        if algorithm == "native":
            return lambda: dist.all_reduce(x, group=group)
        return lambda: all_reduce(x, algorithm, ranks, node_size)
    if collective == "reduce_scatter":
        out = torch.empty(x.numel() // p, dtype=x.dtype, device=x.device)
        return {"native": lambda: reduce_scatter_flat(out, x, group=group),
                "ring": lambda: ring_reduce_scatter(x, ranks), "recursive": lambda: recursive_reduce_scatter(x, ranks)}[algorithm]
    if collective == "all_gather":
        whole = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
        part = x[:x.numel() // p]
        return {"native": lambda: all_gather_flat(whole, part, group=group),
                "ring": lambda: ring_all_gather(x, ranks), "recursive": lambda: recursive_all_gather(x, ranks)}[algorithm]
    if collective == "broadcast":
        return {"native": lambda: dist.broadcast(x, ranks.global_rank(0), group=group),
                "binomial": lambda: binomial_broadcast(x, ranks), "chain": lambda: chain_broadcast(x, ranks)}[algorithm]
    out = torch.empty_like(x)
    return {"native": lambda: dist.all_to_all_single(out, x, group=group),
            "pairwise": lambda: pairwise_all_to_all(out, x, ranks)}[algorithm]


@contextlib.contextmanager
def counting_sends(sent: list[int]):
    """Record the bytes of every point-to-point send (the hand-written collectives' `send` and
    `batch_isend_irecv` both go through torch.distributed's isend)."""
    original = c10d.isend

    def isend(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    c10d.isend = dist.isend = isend
    try:
        yield
    finally:
        c10d.isend = dist.isend = original


def busiest_sent_bytes(fn) -> int:
    """Bytes the busiest rank sends in one call of fn (collective)."""
    sent: list[int] = []
    dist.barrier()
    with counting_sends(sent):
        fn()
    total = torch.tensor([sum(sent)], dtype=torch.int64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return int(total)


def time_call(fn, iterations: int, warmup: int, device: torch.device) -> float:
    """Seconds per call, the slowest rank's."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / iterations


BESIDE_BURST = 0.002  # seconds of compute before each collective the cluster file's [collectives] time
ARRIVAL_BURSTS = (0.0, 0.0005, 0.002, 0.005, 0.01, 0.02)  # the compute before the [arrival] all-reduces


def time_beside_compute(fn, iterations: int, device: torch.device, burst: float = BESIDE_BURST,
                        after=None) -> float:
    """Seconds of one call made right after `burst` seconds of matmuls on every rank, as a training step's
    collectives are (the ranks arrive from their own compute, a little apart, the backend's threads idle since
    the last call), averaged over the calls and the ranks: what a step spends in it. On this project's shared
    CPU a 512 KB gloo all-reduce takes 0.7 ms called back to back and 2-2.5 ms beside compute on average.
    after: called untimed with what `fn` returned (waiting for what it posted)."""
    a = torch.randn(128, 128, device=device)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.02:
        a @ a
        calls += 1
    per_burst = torch.tensor(max(1, round(burst / ((time.perf_counter() - start) / calls))), dtype=torch.float64)
    dist.all_reduce(per_burst, op=dist.ReduceOp.MIN)  # the same compute on every rank
    total = 0.0
    for i in range(iterations + 2):  # two warm-up calls
        for _ in range(int(per_burst)):
            a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        posted = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        total += time.perf_counter() - begin if i >= 2 else 0.0
        if after is not None:
            after(posted)
    mean = torch.tensor(total / iterations, dtype=torch.float64)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def measure_arrival(device: torch.device, bursts: tuple[float, ...] = ARRIVAL_BURSTS, iterations: int = 40) -> dict:
    """The cluster file's [arrival] (plan/cluster.py ArrivalSpec): a 4-byte all-reduce over the world timed
    after each of `bursts` seconds of compute on every rank (`time_beside_compute`), as
    {"after_us": BESIDE_BURST in us, "ranks": world size, "measured": [[us of compute, us], ...]} (collective).
    Its time grows with the compute before it: the ranks arrive further apart the longer they computed."""
    x = torch.zeros(1, device=device)
    points = [[burst * 1e6, time_beside_compute(lambda: dist.all_reduce(x), iterations, device, burst) * 1e6]
              for burst in bursts]
    return {"after_us": BESIDE_BURST * 1e6, "ranks": dist.get_world_size(), "measured": points}


POST_SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20)  # bytes each way: ring attention's K/V blocks of small models


def measure_post(device: torch.device, sizes: tuple[int, ...] = POST_SIZES, iterations: int = 20) -> dict:
    """The time a rank's own thread spends posting one ring exchange (a send to the next rank and a receive from the
    previous, one batch_isend_irecv: ring attention's and the overlapped tensor-parallel rings' hop) right after a
    burst of compute on every rank, the transfer waited for untimed (collective). gloo writes the message into the
    socket from the caller, so the post is work on the rank's thread that no overlap hides. Returns
    {"p2p_post_us", "p2p_post_gbs" (0: no per-byte part), "measured": [[bytes, us], ...]}: the least-squares line
    through the measured times (the accelerator's post_seconds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    points = []
    for size in sizes:
        send = torch.zeros(size // 4, device=device)
        recv = torch.empty_like(send)

        def post():
            return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                           dist.P2POp(dist.irecv, recv, (rank - 1) % world)])

        def wait(works):
            for work in works:
                work.wait()

        points.append([float(size), time_beside_compute(post, iterations, device, after=wait) * 1e6])
    return fit_post(points)


def measure_ring_host_here() -> dict:
    """Ring attention's own Python per ring step (plan/ring_host.py), measured on every rank at once and averaged
    (collective): {"ring_step_operators", "measured": rank 0's rows}."""
    from fivefold.plan.ring_host import measure_ring_host

    return _mean_over_ranks(measure_ring_host(), "ring_step_operators")


def measure_expert_groups_here() -> dict:
    """The grouped GEMM's fixed cost per expert and call (plan/expert_host.py), measured on every rank at once and
    averaged (collective): {"expert_group_us", "measured": rank 0's rows}."""
    from fivefold.plan.expert_host import measure_expert_groups

    return _mean_over_ranks(measure_expert_groups(), "expert_group_us")


def _mean_over_ranks(result: dict, key: str) -> dict:
    """{key: the ranks' mean of result[key], "measured": this rank's rows} (collective)."""
    mean = torch.tensor(result[key], dtype=torch.float64)
    dist.all_reduce(mean)
    return {key: float(mean) / dist.get_world_size(), "measured": result["measured"]}


def fit_post(points: list[list[float]]) -> dict:
    """The least-squares line through [bytes, us] points as {"p2p_post_us", "p2p_post_gbs", "measured"}; a line
    that does not rise is their mean (no per-byte part: p2p_post_gbs 0)."""
    line = fit_link([x for x, _ in points], [y for _, y in points])  # alpha in us, beta in us per byte
    if line.beta <= 0:
        return {"p2p_post_us": statistics.fmean(y for _, y in points), "p2p_post_gbs": 0.0, "measured": points}
    return {"p2p_post_us": line.alpha, "p2p_post_gbs": 1e-3 / line.beta, "measured": points}


def _times_by_size(rows: list[Row], collective: str) -> tuple[tuple[float, float], ...]:
    """(bytes, mean seconds) of a backend collective's rows, ascending."""
    by_size: dict[int, list[float]] = {}
    for r in rows:
        if r.collective == collective and r.algorithm == "native":
            by_size.setdefault(r.size, []).append(r.time_us * 1e-6)
    return tuple((float(size), statistics.fmean(times)) for size, times in sorted(by_size.items()))


def fit_native_links(rows: list[Row], p: int, subgroups: dict[int, list[Row]] | None = None) -> dict[str, Link]:
    """Per backend collective measured at two or more sizes: the link its ring form runs at (cost.fit_native_link),
    carrying its times, and its times over groups of fewer ranks (`subgroups`: rows per group size) as well."""
    fitted = {}
    for collective in NATIVE_COLLECTIVES:
        mine = [r for r in rows if r.collective == collective and r.algorithm == "native"]
        if p > 1 and len({r.size for r in mine}) >= 2:
            line = fit_native_link(collective, p, [r.size for r in mine], [r.time_us * 1e-6 for r in mine])
            groups = tuple((q, points) for q, group_rows in sorted((subgroups or {}).items())
                           if len(points := _times_by_size(group_rows, collective)) >= 2)
            fitted[collective] = replace(line, ranks=p, measured=_times_by_size(rows, collective), subgroups=groups)
    return fitted


def subgroup_sizes(p: int) -> list[int]:
    """The group sizes, between 2 and p - 1, that divide p ranks into equal groups (a layout's smaller folds)."""
    return [q for q in range(2, p) if p % q == 0]


def measure_native_links(device: torch.device, sizes: tuple[int, ...] = (16 << 10, 64 << 10, 256 << 10, 512 << 10,
                                                                       1 << 20, 4 << 20),
                         iterations: int = 20, beside_compute: bool = False) -> dict[str, Link]:
    """Time the backend's own collectives over the world at `sizes` bytes per rank and fit their links (collective),
    each carrying its measured times too (`Link.measured`, read by comm/cost.py native_collective at this world size);
    beside_compute: each call after a burst of compute (`time_beside_compute`), as a training step makes them.
    Over groups of each smaller size dividing the world as well (`subgroup_sizes`: consecutive ranks, every group
    calling at once, as a layout's tensor- or data-parallel groups do; `Link.subgroups`): on a CPU whose cores the
    ranks share, a pair's call inside a world of four waits on the other ranks' compute too.

    The sizes span what a training step sends (a tensor-parallel all-reduce of a small model is tens
    of KB to a MB, a DDP bucket MBs) and the fit weighs them alike (`fit_link(relative=True)`): on a
    shared CPU a gloo collective's fixed cost is milliseconds, which a fit ruled by the large sizes misses.
    """
    def timed(ranks: Ranks) -> list[Row]:
        rows = []
        for collective in NATIVE_COLLECTIVES:
            for size in sizes:
                count = max(ranks.size, size // 4 // ranks.size * ranks.size)
                x = torch.zeros(count, dtype=torch.float32, device=device)
                call = operation(collective, "native", x, ranks, ranks.size)
                seconds = time_beside_compute(call, iterations, device) if beside_compute else \
                    time_call(call, iterations, 2, device)
                rows.append(Row(collective, "native", count * 4, count, "float32", seconds * 1e6, 0.0, 0.0, None))
        return rows

    world = Ranks.world()
    subgroups = {}
    for q in subgroup_sizes(world.size):  # consecutive groups of q, all at once; freed after (live groups slow steps)
        own, _ = dist.new_subgroups(group_size=q)
        subgroups[q] = timed(Ranks.of_group(own))
        dist.destroy_process_group(own)
    return fit_native_links(timed(world), world.size, subgroups)


def sizes_between(low: int, high: int, factor: int) -> list[int]:
    out, size = [], low
    while size <= high:
        out.append(size)
        size *= factor
    return out


def run(args: argparse.Namespace) -> dict:
    """Measure every requested row; every rank returns the same report."""
    p = dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" else torch.device("cpu")
    ranks = Ranks.world()
    node_size = args.node_size or default_node_size(ranks)
    cluster = measure_cluster(ranks, node_size)
    # the runtime's AdamW, timed before the collectives (a GPU's fused AdamW streams its bytes once: the planner's
    # default, the memory bandwidth, holds there)
    optimizer = optimizer_rate(device) if args.cluster_file and device.type == "cpu" else (0.0, 0.0)
    # the codecs' local work likewise (a GPU's codecs stream memory: the planner's CODEC_BYTES at its bandwidth)
    codecs = codec_rates(device) if args.cluster_file and device.type == "cpu" else ({}, {})
    rows = []
    for collective in args.collectives:
        for algorithm in args.algorithms or ALGORITHMS[collective]:
            if algorithm not in ALGORITHMS[collective]:
                continue
            for size in sizes_between(args.min_bytes, args.max_bytes, args.factor):
                count = max(p, size // 4 // p * p)  # float32 elements, a multiple of p
                x = torch.zeros(count, dtype=torch.float32, device=device)
                iterations = max(2, min(args.iters, math.ceil(args.bytes_per_row / (count * 4))))
                call = operation(collective, algorithm, x, ranks, node_size)
                seconds = time_call(call, iterations, args.warmup, device)
                nbytes = count * 4
                algbw = nbytes / seconds / 1e9
                predicted, sent, predicted_bytes = None, None, None
                if algorithm != "native":
                    predicted = predict_collective(collective, algorithm, nbytes, p, cluster) * 1e6
                    sent = busiest_sent_bytes(call)
                    try:
                        predicted_bytes = traffic(collective, algorithm, nbytes, p, node_size)[1]
                    except ValueError:  # no closed-form count for this algorithm at this p (e.g. chain)
                        predicted_bytes = None
                rows.append(Row(collective, algorithm, nbytes, count, "float32", seconds * 1e6, algbw,
                                algbw * bus_factor(collective, p), predicted, sent, predicted_bytes))
    rates = {dtype: matmul_tflops(dtype, device) for dtype in ("fp32", "bf16")} if args.cluster_file else {}
    bandwidth = memory_gbs(device) if args.cluster_file else 0.0
    efficiency = oversubscribed_efficiency(device, available_cores(), torch.get_num_threads(), rates["fp32"]) \
        if args.cluster_file else 1.0
    native = {name: asdict(link) for name, link in fit_native_links(rows, p).items()}
    # the cluster file's collectives: timed as a training step makes them, each after a burst of compute
    beside = {name: asdict(link) for name, link in measure_native_links(device, beside_compute=True).items()} \
        if args.cluster_file and p > 1 else {}
    arrival = measure_arrival(device) if args.cluster_file and p > 1 else {}
    posting = measure_post(device) if args.cluster_file and p > 1 and device.type == "cpu" else {}
    ring_host = measure_ring_host_here() if args.cluster_file and device.type == "cpu" else {}
    expert_groups = measure_expert_groups_here() if args.cluster_file and device.type == "cpu" else {}
    return {"world_size": p, "backend": dist.get_backend(), "device": device.type, "node_size": node_size,
            "links": {"intra": asdict(cluster.intra), "inter": asdict(cluster.inter)}, "native_links": native,
            "native_links_beside_compute": beside, "arrival": arrival, "post": posting, "ring_host": ring_host,
            "expert_groups": expert_groups,
            "matmul_tflops": rates, "memory_gbs": bandwidth, "oversubscribed_efficiency": efficiency,
            "optimizer_gbs": optimizer[0], "optimizer_tensor_us": optimizer[1],
            "codec_ns": codecs[0], "codec_encode_ns": codecs[1],
            "rows": [asdict(r) | {"measured_over_predicted": r.ratio} for r in rows]}


# the matmul each dtype's rate is timed on: large enough that the backend spreads it over a rank's threads. On the
# AMX Xeon of 2026-11-27, oneDNN ran a 512 x 512 bf16 matmul at 1.19 TFLOP/s on one thread and 1.15 on two (2.23
# on two at 2048), so a 512 bf16 rate said a rank of one thread computes as fast as a rank of two, where a small
# model's bf16 step on two ranks of one thread took twice the one-rank step, as in fp32 (0.185 and 0.364 at 512)
MATMUL_SIZE = {"fp32": 512, "bf16": 2048}
SMALL_MATMUL = 512  # where a call of MATMUL_SIZE would take over half the timing (bf16 emulated on an AVX2 CPU)


def matmul_size(dtype: str, small_call: float, seconds: float) -> int:
    """The matmul a dtype's rate is timed on: its MATMUL_SIZE, unless one call of it, projected from a
    SMALL_MATMUL call's `small_call` seconds (cubic in n), would take over half of the `seconds` of timing."""
    n = MATMUL_SIZE[dtype]
    return SMALL_MATMUL if n > SMALL_MATMUL and small_call * (n / SMALL_MATMUL) ** 3 > seconds / 2 else n


def _square_operands(dtype: str, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random n x n matrices in `dtype`, multiplied once (warm-up)."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=device).to(torch_dtype)
    b = torch.randn(n, n, device=device).to(torch_dtype)
    a @ b
    _synchronize(device)
    return a, b


def matmul_tflops(dtype: str, device: torch.device, n: int = 0, seconds: float = 0.5, computing: int = 0) -> float:
    """TFLOP/s of an n x n matmul on every rank at once, the slowest rank's (collective). n = 0: the dtype's
    MATMUL_SIZE, or SMALL_MATMUL where one call of it would take over half of `seconds` on some rank (read
    off a SMALL_MATMUL call: an AVX2 CPU emulates bf16 at about a GFLOP/s, 14 s a 2048 call). computing > 0: only
    the first `computing` ranks multiply while the others wait (a CPU host's rate when its cores are not shared)."""
    if not n:
        n = MATMUL_SIZE[dtype]
        if n > SMALL_MATMUL:
            a, b = _square_operands(dtype, SMALL_MATMUL, device)
            start = time.perf_counter()
            a @ b
            _synchronize(device)
            slowest = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank times the same size
            n = matmul_size(dtype, float(slowest), seconds)
    a, b = _square_operands(dtype, n, device)
    dist.barrier()
    calls, start = 0, time.perf_counter()
    if not computing or dist.get_rank() < computing:
        while time.perf_counter() - start < seconds:
            a @ b
            calls += 1
        _synchronize(device)
        value = 2 * n**3 * calls / (time.perf_counter() - start) / 1e12
    else:
        value = math.inf
    rate = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def matmul_tflops_together(dtype: str, device: torch.device, rate: float, seconds: float = 0.2,
                           n: int = SMALL_MATMUL) -> float:
    """TFLOP/s per rank of the same number of n x n matmuls on every rank, from a barrier until the last rank is done
    (collective): the rate a step's ranks achieve together, where `matmul_tflops` gives the slowest rank's over a
    fixed window. `rate` (TFLOP/s, e.g. that slowest rate) sizes the work to about `seconds`. On accelerators the
    two agree; ranks time-sliced on shared cores catch up on each other at the barrier, so the slowest rank's rate
    can lie well below (2026-11-27, 4 one-thread ranks on 2 cores: 0.0727 against 0.0860)."""
    a, b = _square_operands(dtype, n, device)
    calls = max(1, round(seconds * rate * 1e12 / (2 * n**3)))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        a @ b
    _synchronize(device)
    dist.barrier()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return 2 * n**3 * calls / float(elapsed) / 1e12


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ranks_fitting(cores: int, threads: int) -> int:
    """How many ranks of `threads` intra-op threads each the `cores` hold without time-slicing."""
    return max(1, cores // threads)


def oversubscribed_share(ranks: int, rate_all: float, fitting: int, rate_fitting: float) -> float:
    """Throughput of `ranks` ranks computing at once (each at `rate_all`) over that of `fitting` ranks computing
    alone (each at `rate_fitting`), at most 1: the cluster file's accelerator.oversubscribed_efficiency."""
    return min(1.0, ranks * rate_all / (fitting * rate_fitting))


def oversubscribed_efficiency(device: torch.device, cores: int, threads: int, rate_all: float, seconds: float = 0.5) -> float:
    """A CPU host's throughput with every rank's threads on its `cores` over its throughput with only as many ranks
    computing as the cores hold (the fp32 matmul rate both ways; 1 when the threads fit the cores)."""
    p = dist.get_world_size()
    if device.type != "cpu" or p * threads <= cores:
        return 1.0
    fit = ranks_fitting(cores, threads)
    return oversubscribed_share(p, rate_all, fit, matmul_tflops("fp32", device, seconds=seconds, computing=fit))


def memory_gbs(device: torch.device, nbytes: int = 32 << 20, seconds: float = 0.5) -> float:
    """GB/s of an in-place float32 add (reads two vectors, writes one) on every rank at once, the slowest rank's."""
    x = torch.ones(nbytes // 4, device=device)
    y = torch.ones(nbytes // 4, device=device)
    x.add_(y)
    dist.barrier()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x.add_(y)
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = torch.tensor(3 * nbytes * calls / (time.perf_counter() - start) / 1e9, dtype=torch.float64, device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate)


def optimizer_rate(device: torch.device, params: int = 1 << 21, few: int = 16, many: int = 512,
                   seconds: float = 0.3) -> tuple[float, float]:
    """(GB/s of AdamW's 28 bytes per parameter, microseconds per tensor): the runtime's AdamW (optim.py
    build_adamw) stepping the same `params` parameters held in `few` and in `many` tensors, on every rank at
    once, the slowest rank's; the step is params x c + tensors x u, solved for c and u from the two timings."""
    from fivefold.config import OptimConfig
    from fivefold.optim import build_adamw

    def step_seconds(tensors: int) -> float:
        weights = [torch.zeros(params // tensors, device=device, requires_grad=True) for _ in range(tensors)]
        for w in weights:
            w.grad = torch.full_like(w, 1e-3)
        optimizer = build_adamw(weights, [], OptimConfig())
        optimizer.step()  # allocates the moments
        dist.barrier()
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            optimizer.step()
            calls += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor((time.perf_counter() - start) / calls, dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    return optimizer_constants(params // few * few, few, step_seconds(few), params // many * many, many,
                               step_seconds(many))


@dataclass
class _CodecBucket:
    """What a codec reads of a DDP bucket (parallel/data_parallel.py Bucket): its parameters, their offsets, the buffer."""
    params: list[torch.Tensor]
    offsets: list[int]
    buffer: torch.Tensor


def codec_rates(device: torch.device, tensors: list[torch.Tensor] | None = None,
                seconds: float = 0.3) -> tuple[dict, dict]:
    """({codec: ns per value of its bucket reduction}, {two-phase codec: ns per value of its compression}): the
    runtime's codecs (comm/compression.py, default options) reducing one bucket of `tensors` (their shapes and
    values: a model's gradients; default one bucket of the default 25 MB of 1024 x 1024 matrices and vectors,
    normal values) over a one-rank group, so what is timed is their local work alone, on every rank at once, the
    slowest rank's (plan/cluster.py Accelerator.codec_seconds). The rate per value depends on the bucket's size
    (caches) and shapes (PowerSGD works per matrix), and top-k's on the values' distribution."""
    from fivefold.comm.compression import CODECS, build_codec
    from fivefold.comm.reducers import NativeReducer

    if tensors is None:
        generator = torch.Generator().manual_seed(0)
        tensors = [torch.randn(shape, generator=generator).to(device) for shape in [(1024, 1024)] * 6 + [(1024,)] * 6]
    own, _ = dist.new_subgroups(group_size=1)
    # glibc maps a large block afresh (page faults on every first touch: the codecs' temporaries then cost twice as
    # much) until a freed mapped block raises its threshold, as happens early in any training process; do it here
    torch.empty(30 << 18).fill_(0)
    params = [t.detach() for t in tensors]
    offsets = [sum(q.numel() for q in params[:i]) for i in range(len(params))]
    values = sum(q.numel() for q in params)
    data = torch.cat([q.reshape(-1).float() for q in params])

    def timed(call) -> float:
        """The median call's ns per value (a CPU's calls swing by 2x as the allocator maps fresh pages or not)."""
        for _ in range(2):  # warm up (and allocate the error-feedback memory)
            call()
        dist.barrier()
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 3:
            begin = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
        elapsed = torch.tensor(statistics.median(times) / values * 1e9, dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    whole, encode = {}, {}
    for name in CODECS[1:]:
        codec = build_codec(name, own, NativeReducer(own))
        bucket = _CodecBucket(params, offsets, data.clone())
        whole[name] = timed(lambda: codec.reduce(0, bucket))
        if hasattr(codec, "encode"):
            x = torch.zeros(codec._padded(values), device=device)
            x[:values] = data
            encode[name] = timed(lambda: codec._compress("rate", x))
    dist.destroy_process_group(own)
    return whole, encode


def optimizer_constants(params_a: int, tensors_a: int, seconds_a: float, params_b: int, tensors_b: int,
                        seconds_b: float) -> tuple[float, float]:
    """(GB/s of 28 bytes per parameter, microseconds per tensor) of a step taking params x c + tensors x u, solved
    from two timings; a cost per tensor below 0 (timing noise) is taken as 0 and c is then timing a's alone."""
    det = params_a * tensors_b - params_b * tensors_a
    if not det:
        raise ValueError("two timings with the same tensors per parameter cannot separate the two costs")
    per_param = (seconds_a * tensors_b - seconds_b * tensors_a) / det
    per_tensor = (params_a * seconds_b - params_b * seconds_a) / det
    if per_tensor < 0:
        per_param, per_tensor = seconds_a / params_a, 0.0
    return 28 / max(per_param, 1e-15) / 1e9, per_tensor * 1e6


def cluster_file_of(report: dict) -> str:
    """This machine as a planner cluster file: achieved matmul rates (use `plan --efficiency 1`), fitted links."""
    from fivefold.plan.cluster import Accelerator, ClusterSpec, LinkSpec, arrival_from_dict, cluster_toml

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / report["node_size"] / 2**30
    spec_ = ClusterSpec(f"this-machine-{report['backend']}",
                        Accelerator(f"{report['device']} rank", round(memory, 2), report["matmul_tflops"],
                                    report["memory_gbs"], shared_cores=available_cores() if report["device"] == "cpu" else 0,
                                    oversubscribed_efficiency=report.get("oversubscribed_efficiency", 1.0),
                                    optimizer_gbs=report.get("optimizer_gbs", 0.0),
                                    optimizer_tensor_us=report.get("optimizer_tensor_us", 0.0),
                                    codec_ns=report.get("codec_ns", {}), codec_encode_ns=report.get("codec_encode_ns", {}),
                                    p2p_post_us=report.get("post", {}).get("p2p_post_us", 0.0),
                                    p2p_post_gbs=report.get("post", {}).get("p2p_post_gbs", 0.0),
                                    ring_step_operators=report.get("ring_host", {}).get("ring_step_operators", 0.0),
                                    expert_group_us=report.get("expert_groups", {}).get("expert_group_us", 0.0)),
                        report["node_size"], LinkSpec.from_fit(report["links"]["intra"]), LinkSpec.from_fit(report["links"]["inter"]),
                        source=f"fivefold bench comm on {report['world_size']} ranks: fitted links and native "
                               "collectives, timed matmuls (achieved rates: plan with --efficiency 1)",
                        collectives={name: LinkSpec.from_fit(link) for name, link in
                                     (report.get("native_links_beside_compute") or report.get("native_links", {})).items()},
                        arrival=arrival_from_dict(report.get("arrival", {}), "bench comm"))
    return cluster_toml(spec_)


def format_table(report: dict) -> str:
    intra, inter = report["links"]["intra"], report["links"]["inter"]
    lines = [
        f"# fivefold bench comm: {report['world_size']} ranks, {report['backend']} on {report['device']}, "
        f"node size {report['node_size']}",
        f"# fitted links: intra alpha {intra['alpha'] * 1e6:.1f} us, {1 / max(intra['beta'], 1e-30) / 1e9:.2f} GB/s; "
        f"inter alpha {inter['alpha'] * 1e6:.1f} us, {1 / max(inter['beta'], 1e-30) / 1e9:.2f} GB/s; "
        f"reduction {1 / max(intra['gamma'], 1e-30) / 1e9:.2f} GB/s",
        f"# {'collective':<15}{'algorithm':<17}{'size(B)':>10}{'count':>10}{'type':>8}{'time(us)':>12}"
        f"{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}{'pred(us)':>11}{'meas/pred':>10}{'sent(B)':>10}{'pred(B)':>10}",
    ]
    for r in report["rows"]:
        predicted = f"{r['predicted_us']:>11.1f}" if r["predicted_us"] else f"{'-':>11}"
        ratio = f"{r['measured_over_predicted']:>10.2f}" if r["measured_over_predicted"] else f"{'-':>10}"
        sent = f"{r['sent_bytes']:>10}" if r["sent_bytes"] is not None else f"{'-':>10}"
        predicted_bytes = f"{r['predicted_bytes']:>10.0f}" if r["predicted_bytes"] is not None else f"{'-':>10}"
        lines.append(f"  {r['collective']:<15}{r['algorithm']:<17}{r['size']:>10}{r['count']:>10}{r['dtype']:>8}"
                     f"{r['time_us']:>12.1f}{r['algbw_gbs']:>13.3f}{r['busbw_gbs']:>13.3f}{predicted}{ratio}"
                     f"{sent}{predicted_bytes}")
    if report.get("optimizer_gbs"):
        lines.append(f"# AdamW step: {report['optimizer_gbs']:.2f} GB/s of 28 bytes per parameter, "
                     f"{report['optimizer_tensor_us']:.1f} us per tensor")
    if report.get("codec_ns"):
        lines.append("# codecs' local work, ns per gradient value (compression): " + ", ".join(
            f"{name} {ns:.1f}" + (f" ({report['codec_encode_ns'][name]:.1f})" if name in report.get("codec_encode_ns", {})
                                   else "") for name, ns in report["codec_ns"].items()))
    for name, link in report.get("native_links", {}).items():
        lines.append(f"# native {name} fitted (ring form): alpha {link['alpha'] * 1e6:.1f} us, "
                     f"{1 / max(link['beta'], 1e-30) / 1e9:.2f} GB/s")
    if report.get("arrival", {}).get("measured"):
        lines.append("# arrival skew (4-byte all-reduce after compute): " + ", ".join(
            f"{c / 1e3:g} ms {t:.0f} us" for c, t in report["arrival"]["measured"]))
    if report.get("post", {}).get("measured"):
        lines.append("# ring exchange posted beside compute (a rank's own time): " + ", ".join(
            f"{size / 1024:.0f} KB {us:.0f} us" for size, us in report["post"]["measured"]))
    if report.get("ring_host", {}).get("measured"):
        lines.append(f"# ring attention's own Python: {report['ring_host']['ring_step_operators']:.1f} operators' worth "
                     "per ring step and block pass (plan/ring_host.py)")
    if report.get("expert_groups", {}).get("measured"):
        lines.append(f"# grouped GEMM's fixed cost: {report['expert_groups']['expert_group_us']:.1f} us per expert and call "
                     "(plan/expert_host.py: " + ", ".join(f"{e} experts {us / 1e3:.2f} ms" for e, us in
                                                         report["expert_groups"]["measured"]) + ")")
    for name, link in report.get("native_links_beside_compute", {}).items():
        lines.append(f"# native {name} beside compute (the cluster file's): "
                     + ", ".join(f"{size / 1024:.0f} KB {us * 1e6:.0f} us" for size, us in link["measured"]))
        for ranks, points in link.get("subgroups", ()):
            lines.append(f"#   over groups of {ranks}, all at once: "
                         + ", ".join(f"{size / 1024:.0f} KB {us * 1e6:.0f} us" for size, us in points))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=4, help="ranks to start (under torchrun)")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), help=f"comma list of {', '.join(COLLECTIVES)}")
    parser.add_argument("--algorithms", default="", help="comma list to keep (default: every algorithm and native)")
    parser.add_argument("--min-bytes", default="1K", help="smallest vector per rank (e.g. 1K)")
    parser.add_argument("--max-bytes", default="16M", help="largest vector per rank (e.g. 16M)")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    parser.add_argument("--iters", type=int, default=20, help="most timed calls per row")
    parser.add_argument("--bytes-per-row", default="256M", help="fewer calls for large sizes: about this many bytes per row")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--node-size", type=int, default=0, help="ranks per (pretend) node; 0 = LOCAL_WORLD_SIZE")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--cluster-file", help="also time matmuls and write this machine as a `fivefold plan --cluster` file")


def _normalise(args: argparse.Namespace) -> argparse.Namespace:
    args.collectives = [c for c in args.collectives.split(",") if c]
    unknown = [c for c in args.collectives if c not in COLLECTIVES]
    if unknown:
        raise SystemExit(f"fivefold bench comm: unknown collective(s) {', '.join(unknown)}; use {', '.join(COLLECTIVES)}")
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    try:
        args.min_bytes, args.max_bytes = parse_bytes(args.min_bytes, "--min-bytes"), parse_bytes(args.max_bytes, "--max-bytes")
        args.bytes_per_row = parse_bytes(args.bytes_per_row, "--bytes-per-row")
    except ConfigError as exc:
        raise SystemExit(f"fivefold bench comm: {exc}") from None
    if args.factor < 2 or args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        raise SystemExit("fivefold bench comm: need --factor >= 2 and 4 <= --min-bytes <= --max-bytes")
    return args


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options of `fivefold bench comm` (exits with a usage line on a bad one)."""
    parser = argparse.ArgumentParser(prog="fivefold bench comm")
    add_arguments(parser)
    return _normalise(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point of each rank (python -m fivefold.comm.bench under torchrun)."""
    args = parse(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        report = run(args)
        if dist.get_rank() == 0:
            print(format_table(report), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2))
                print(f"wrote {args.json}")
            if args.cluster_file:
                Path(args.cluster_file).write_text(cluster_file_of(report))
                print(f"wrote {args.cluster_file}")
        dist.barrier()  # every rank at the end before any tears its connections down (gloo can abort otherwise)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
