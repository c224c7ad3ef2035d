"""Cluster descriptions for the planner: accelerator peak rates and memory, and the two links of a node grid.

A cluster is `accelerators_per_node` accelerators joined inside a node by one link (NVLink through
NVSwitch on the GPU presets) and across nodes by another (InfiniBand, one NIC per GPU: a rail-
optimised fat tree), each described by its bandwidth per accelerator per direction and a message
latency. `ClusterSpec.links()` turns that into comm/cost.py's alpha-beta `Cluster` (alpha =
latency, beta = 1 / bandwidth), so the planner prices every collective with the same formulas the
runtime's `auto` all-reduce choice and `fivefold bench comm` use.

Presets come from vendors' data sheets (dense rates, no structured sparsity; docs/planner.md cites
each). Latencies are not data-sheet figures: they are typical NCCL small-message latencies and are
marked as such. The CPU machine of this project is described by a file `fivefold bench comm
--cluster-file` writes from its own fitted links and a timed matmul.

A cluster file is TOML, read without running anything:

    name = "my-h100-pod"
    accelerators_per_node = 8
    nodes = 128                      # optional: 0 = as many as a job asks for
    host_bandwidth_gbs = 64          # optional (default 32): accelerator <-> host, for ZeRO-Offload
    nvme_bandwidth_gbs = 25          # optional (default 25): a node's local drives, for NVMe offload
    [accelerator]
    name = "H100-SXM"
    memory_gib = 80
    tflops = {fp32 = 67, bf16 = 989.5}
    memory_bandwidth_gbs = 3350      # optional: memory-bound work (kept activations, the optimizer step)
    memory_efficiency = 0.74         # optional (default 1): the share of it memory-bound kernels reach
    pass_overhead_us = 0             # optional: fixed host cost of a dense block's forward (backward: twice)
    shared_cores = 0                 # optional: a CPU host's cores that all its ranks share (0: none)
    oversubscribed_efficiency = 1.0  # optional: its throughput with more threads than cores, over with as many
    optimizer_gbs = 3350             # optional (default: memory_bandwidth_gbs): AdamW's 28 bytes per parameter
    optimizer_tensor_us = 0          # optional: AdamW's fixed cost per parameter tensor it updates
    codec_ns = {int8 = 22.4}         # optional: a gradient codec's bucket reduction, ns per value (on one rank)
    codec_encode_ns = {int8 = 2.1}   # optional: the two-phase codecs' compression within it
    ring_step_operators = 0          # optional: ring attention's own Python per ring step (plan/ring_host.py)
    expert_group_us = 0              # optional: a grouped GEMM's fixed cost per expert and call (plan/expert_host.py)
    [intra]                          # inside a node, per accelerator and direction
    bandwidth_gbs = 450
    latency_us = 3
    [inter]                          # across nodes
    bandwidth_gbs = 50
    latency_us = 6
    [collectives.all_reduce]         # optional: the backend's own collective inside a node, fitted
    bandwidth_gbs = 0.9              # (ring form, comm/cost.py native_collective) by bench comm
    latency_us = 900
    ranks = 2                        # optional: the times it was fitted to, over this many ranks,
    measured = [[16384, 450.0], [524288, 1900.0], [4194304, 4300.0]]   # [bytes, us]: read at that size
    # subgroups = [{ranks = 2, measured = [[16384, 1900.0], [4194304, 5700.0]]}]   # with ranks = 4: its pairs
    [topology]                       # optional, for `fivefold simulate` (sim/topology.py)
    kind = "fat_tree"                # nvswitch | fat_tree | rail_optimized | torus_2d
    nodes_per_leaf = 4               # nodes per leaf switch (rail_optimized: per rail group)
    spines = 0                       # 0: one per leaf down port
    oversubscription = 1.0           # leaf down / up capacity (1 = full bisection)
    routing = "ecmp"                 # ecmp | ecmp_paths | spray (sim/routing.py)
    subflows = 4                     # ecmp_paths: flows per message
    seed = 0                         # ECMP hash seed
    torus = [4, 4]                   # torus_2d: x, y (x * y accelerators)
    [arrival]                        # optional: how late a sync point's last rank arrives (CPU hosts)
    after_us = 2000                  # the compute before each of [collectives]'s measured calls
    ranks = 2                        # the ranks the all-reduce spanned
    measured = [[0, 600.0], [5000, 1500.0], [20000, 2300.0]]   # [us of compute before, us of a tiny all-reduce]

`[collectives.<name>]` (all_reduce, reduce_scatter, all_gather, all_to_all) replaces the intra
link for that collective when it runs natively within a node: `fivefold bench comm --cluster-file`
fits it from the backend's measured times, because gloo's collectives on a shared CPU run slower
than its point-to-point messages predict, and writes those times too (`ranks`, `measured`): at that
many ranks the planner interpolates them, since the times bend where a line through them cannot.
Measured over more than two ranks, it also times the collective over each smaller group size that
divides them (`subgroups`: consecutive ranks, every group calling at once, as a layout's tensor- or
data-parallel groups do), and a group of that size reads those times: on a shared CPU a pair's call
among four ranks waits on the other ranks' compute as well, 1.2-1.6x what the four-rank fit's line
puts on a pair (2026-11-29).
The GPU presets leave it out (NCCL is priced on the links).

`[arrival]` is the arrival skew of ranks running the same compute between sync points: on a shared
CPU host the operating system preempts each rank at random, so after T seconds of compute the ranks
reach a blocking collective apart, and the collective lasts until the last one arrives. `bench comm
--cluster-file` times a 4-byte all-reduce after bursts of compute from 0 to 20 ms (`measured`); on
this project's 2-core machine it took 0.6 ms after 2 ms and 1.8-2.3 ms after 10-20 ms. The
collectives above were timed after `after_us` of compute, so they already hold that much skew:
`ClusterSpec.sync_delay(T, p)` is the measured time at T less the time at `after_us` (never below
0; beyond the last point, the last point's; a point below an earlier one is read as that one), scaled from the measured `ranks` to a group of p by the
expected latest of p normal arrivals. The planner and the simulator add it to the collectives a block
pass blocks on (tensor-, context- and expert-parallel); GPU presets leave it out.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from fivefold.comm.cost import NATIVE_COLLECTIVES, Cluster, Link, nondecreasing
from fivefold.errors import ConfigError
from fivefold.sim.names import ROUTINGS, TOPOLOGY_KINDS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


# Bytes a codec's passes move per fp32 gradient value of a bucket on one rank (whole reduction, compression),
# counted from comm/compression.py: int8 pads (4) and copies (8) the bucket, quantises it (|x| 8, block max 4,
# divide 8, round 8, clamp 8, cast 5: 41), decodes and sums the received chunks (13 + 16), quantises its chunk
# again, decodes the gathered codes (13), concatenates (8) and copies back (8); sign adds error feedback to both
# compressions (x + e 12, decoding 32 and subtracting 12 beside 22 of packing: 78) and its decoding is 32; top-k
# feeds back (12), takes |x| (8), selects (four radix passes reading 16), keeps the residual (8), sums into a zeroed
# vector (4) and copies back (8); PowerSGD feeds back (12), reads each matrix for M Q, M^T P (8) and the residual's
# product (4), subtracts (12), writes P Q^T into the output (4 + 8) over a zeroed vector (4) and copies back (8).
# An estimate for accelerators whose codecs stream memory: a CPU computes slower (`bench comm` measures it).
CODEC_BYTES: dict[str, tuple[int, int]] = {"int8": (152, 41), "sign": (264, 78), "topk": (56, 0), "powersgd": (60, 0)}


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float  # usable memory per accelerator
    tflops: dict[str, float] = field(default_factory=dict)  # dense peak TFLOP/s per compute dtype
    memory_bandwidth_gbs: float = 0.0  # HBM (or DRAM) GB/s for memory-bound work; 0 = not modelled
    # fixed seconds (us) a dense transformer block's forward pass costs beyond its FLOPs and bytes: the host
    # dispatching its few dozen operators one by one (eager mode); backward counts it twice, a MoE block
    # pays it times its operators over a dense block's (plan/operators.py). 0 where
    # launches run ahead of the device and hide (the GPU presets); fitted for a CPU by
    # benchmarks/plan_vs_measured.py
    pass_overhead_us: float = 0.0
    # cores that all ranks of a node share (a CPU host, `tflops` measured with every rank computing): a
    # rank idle in a pipeline bubble lends its cores to the others (parallel/pipeline/simulate.py
    # CoreSharing). 0 where each accelerator computes on its own (every GPU preset)
    shared_cores: int = 0
    # the host's throughput with more rank threads than cores over its throughput with as many (measured by
    # `fivefold bench comm --cluster-file` on a CPU: the matmul rate with every rank computing and with only
    # as many as the cores hold); 1 = ideal time-slicing
    oversubscribed_efficiency: float = 1.0
    # the optimizer step's rate: AdamW's 28 bytes per parameter (read weight, gradient, two moments; write three)
    # over this many GB/s, plus a fixed cost per parameter tensor it updates. 0 GB/s = memory_bandwidth_gbs and
    # 0 us, a fused kernel streaming the bytes once (the GPU presets: PyTorch's fused AdamW); on a CPU the
    # multi-tensor implementation makes several passes and dispatches per tensor, so `fivefold bench comm
    # --cluster-file` times the runtime's own AdamW (comm/bench.py optimizer_rate)
    optimizer_gbs: float = 0.0
    optimizer_tensor_us: float = 0.0
    # gradient compression's local work (comm/compression.py) in ns per gradient value, measured by `fivefold bench
    # comm --cluster-file` running the runtime's codecs on one rank: each codec's whole bucket reduction
    # (`codec_ns`) and, for the two-phase codecs, their compression of it (`codec_encode_ns`), which p ranks do
    # for 1 + 1/p of the bucket where one rank does it twice. A codec left out is priced by the bytes its passes
    # move (`CODEC_BYTES`) at the memory bandwidth (the GPU presets)
    codec_ns: dict[str, float] = field(default_factory=dict)
    codec_encode_ns: dict[str, float] = field(default_factory=dict)
    # the host time a rank's own thread spends posting one point-to-point exchange (a send and a receive of n bytes
    # in one batch_isend_irecv: ring attention's hops, the overlapped tensor-parallel rings), beside the other ranks'
    # compute: p2p_post_us + n / p2p_post_gbs (0 GB/s: no per-byte part). gloo on a CPU writes the message into
    # the socket from the caller, 0.3-0.8 ms here; 0 on the GPU presets (NCCL's kernels post). Measured by
    # `fivefold bench comm --cluster-file` (comm/bench.py measure_post)
    p2p_post_us: float = 0.0
    p2p_post_gbs: float = 0.0
    # ring attention's own Python per ring step and block forward and backward (its autograd functions' loop over
    # the ring's steps, between the operators they dispatch), as so many of a dense block's operators: added to the
    # operators the ring is counted to add (plan/operators.py `ring_host_share`). Measured by `fivefold bench comm
    # --cluster-file` on a CPU (plan/ring_host.py: the runtime's ring on its loopback, profiled); 0 where the host
    # runs ahead of the device (the GPU presets) or where it was not measured
    ring_step_operators: float = 0.0
    # a grouped GEMM's fixed cost per expert and call (us), beside its FLOPs: a CPU's grouped GEMM runs one GEMM per
    # expert, so a MoE block's routed work costs more the more experts a rank holds (plan/expert_host.py). Measured
    # by `fivefold bench comm --cluster-file` on a CPU; 0 where one kernel runs every group (the GPU presets)
    expert_group_us: float = 0.0
    # the share of memory_bandwidth_gbs that PyTorch's memory-bound kernels reach (fused AdamW, the foreach norm,
    # scaling and copies, elementwise work): 1 where the figure is itself a measured rate (`fivefold bench comm
    # --cluster-file` times an in-place add on every rank, comm/bench.py memory_gbs), `STREAMING_SHARE` on the GPU
    # presets, whose figure is the data sheet's peak
    memory_efficiency: float = 1.0

    @property
    def streaming_bytes_per_second(self) -> float:
        """Bytes per second memory-bound work moves (`memory_bandwidth_gbs` x `memory_efficiency`; 0: not modelled)."""
        return self.memory_bandwidth_gbs * 1e9 * self.memory_efficiency

    def post_seconds(self, nbytes: float) -> float:
        """Seconds a rank's thread spends posting one send/receive pair of `nbytes` each (`p2p_post_us`)."""
        return self.p2p_post_us * 1e-6 + (nbytes / (self.p2p_post_gbs * 1e9) if self.p2p_post_gbs else 0.0)

    def optimizer_seconds(self, params: float, tensors: int) -> float:
        """Seconds of one AdamW step over `params` parameters in `tensors` tensors (0 when no rate is known)."""
        rate = self.optimizer_gbs * 1e9 if self.optimizer_gbs else self.streaming_bytes_per_second
        return (28 * params / rate if rate else 0.0) + tensors * self.optimizer_tensor_us * 1e-6

    def clip_seconds(self, params: float, clipping: bool) -> float:
        """The gradient norm before each update over a rank's `params` gradients (parallel/gradient_sync.py: one
        foreach norm, reading 4 bytes each) and, when clipping is on, their scaling (read and write, 8 more; counted
        whenever train.max_grad_norm > 0: an upper bound for steps whose norm stays below it), at the memory
        bandwidth (`streaming_bytes_per_second`; 0 when none is known)."""
        rate = self.streaming_bytes_per_second
        return (12 if clipping else 4) * params / rate if rate else 0.0

    def codec_seconds(self, codec: str, values: float, ranks: int) -> float:
        """Seconds of one DDP bucket of `values` gradients through `codec` over `ranks` ranks, beside its messages:
        R - E (1 - 1/p) per value, R the codec's whole reduction and E its compression as one rank measures them
        (`codec_ns`, `codec_encode_ns`), else the bytes of `CODEC_BYTES` at the memory bandwidth; 0 when neither
        is known."""
        if codec in self.codec_ns:
            whole, encode = self.codec_ns[codec], self.codec_encode_ns.get(codec, 0.0)
            return (whole - encode * (1 - 1 / ranks)) * values * 1e-9
        if codec not in CODEC_BYTES or not self.memory_bandwidth_gbs:
            return 0.0
        whole, encode = CODEC_BYTES[codec]
        return (whole - encode * (1 - 1 / ranks)) * values / self.streaming_bytes_per_second

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.tflops:
            raise ConfigError(f"accelerator {self.name} has no peak rate for {dtype}: add tflops.{dtype} to the "
                              f"cluster file (it lists {', '.join(sorted(self.tflops)) or 'none'})")
        return self.tflops[dtype] * 1e12


@dataclass(frozen=True)
class SubgroupTimes:
    """A native collective's times over groups of `ranks` ranks inside the `ranks` its link was measured on, every
    such group calling at once, (bytes, microseconds) ascending (bench comm measures them)."""

    ranks: int
    measured: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbs: float  # GB/s per accelerator per direction
    latency_us: float
    # a native collective's own times over `ranks` ranks, (bytes, microseconds) ascending (bench comm measures
    # them): at that many ranks the planner interpolates them (comm/cost.py measured_seconds)
    ranks: int = 0
    measured: tuple[tuple[float, float], ...] = ()
    subgroups: tuple[SubgroupTimes, ...] = ()  # and over its smaller groups, read at their size

    def link(self) -> Link:
        return Link(alpha=self.latency_us * 1e-6, beta=1 / (self.bandwidth_gbs * 1e9), ranks=self.ranks,
                    measured=tuple((size, us * 1e-6) for size, us in self.measured),
                    subgroups=tuple((group.ranks, tuple((size, us * 1e-6) for size, us in group.measured))
                                    for group in self.subgroups))

    @classmethod
    def from_fit(cls, link: dict) -> "LinkSpec":
        """The spec of a fitted `Link` given as a dict (comm/bench.py reports; a fit's latency can dip below 0),
        with a native collective's measured times, over the world and its smaller groups, if it carries them."""
        return cls(1 / max(link["beta"], 1e-30) / 1e9, max(link["alpha"], 0.0) * 1e6, link.get("ranks", 0),
                   tuple((size, seconds * 1e6) for size, seconds in link.get("measured", ())),
                   tuple(SubgroupTimes(ranks, tuple((size, seconds * 1e6) for size, seconds in points))
                         for ranks, points in link.get("subgroups", ())))



@dataclass(frozen=True)
class ArrivalSpec:
    """Arrival skew at a sync point (see the module docstring): a tiny all-reduce's microseconds after a burst
    of compute, as (microseconds of compute, microseconds) points with increasing compute, and the burst
    `after_us` the cluster's collectives were measured behind (microseconds, as the file writes them)."""

    after_us: float = 0.0
    measured: tuple[tuple[float, float], ...] = ()
    ranks: int = 0  # the ranks the measured all-reduce spanned

    def at(self, compute: float) -> float:
        """Seconds of the measured call after `compute` seconds of compute: linear between points, flat beyond;
        the points read through the least-squares nondecreasing fit (comm/cost.py `nondecreasing`, as the
        collectives' measured times are): more compute cannot bring the ranks closer, so a dip is a noisy mean,
        and it and the points before it it undercuts are read at their mean."""
        points, us = nondecreasing(self.measured), compute * 1e6
        if us <= points[0][0]:
            return points[0][1] * 1e-6
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if us <= b:
                return (ta + (tb - ta) * (us - a) / (b - a)) * 1e-6
        return points[-1][1] * 1e-6


@functools.lru_cache(maxsize=256)
def expected_latest(n: int) -> float:
    """E[max] of n independent standard normal variables (0.564 for 2, 1.029 for 4, 1.766 for 16): the
    latest of n ranks' arrival times, in standard deviations past their mean (midpoint rule on [-8, 8])."""
    steps, low, high = 4000, -8.0, 8.0
    width = (high - low) / steps
    total = 0.0
    for i in range(steps):
        x = low + (i + 0.5) * width
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * cdf ** (n - 1) * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * width
    return total


@dataclass(frozen=True)
class TopologySpec:
    """The fabric `fivefold simulate` builds (sim/topology.py); the planner only uses intra/inter."""

    kind: str = "fat_tree"
    nodes_per_leaf: int = 4
    spines: int = 0
    oversubscription: float = 1.0
    routing: str = "ecmp"
    subflows: int = 4
    seed: int = 0
    torus: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGY_KINDS:
            raise ConfigError(f"topology.kind = {self.kind!r}: use one of {', '.join(TOPOLOGY_KINDS)}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"topology.routing = {self.routing!r}: use one of {', '.join(ROUTINGS)}")
        for name, low in (("nodes_per_leaf", 1), ("spines", 0), ("subflows", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"topology.{name} = {value!r}: must be an integer >= {low}")
        if isinstance(self.oversubscription, bool) or not isinstance(self.oversubscription, (int, float)) or \
                not math.isfinite(self.oversubscription) or self.oversubscription < 1:
            raise ConfigError(f"topology.oversubscription = {self.oversubscription!r}: must be a number >= 1 "
                              "(1 = full bisection bandwidth)")
        if self.routing == "ecmp_paths" and self.subflows < 2:
            raise ConfigError(f"topology.subflows = {self.subflows}: ecmp_paths needs 2 or more flows per message")
        low = 1 if self.kind == "torus_2d" else 0
        if len(self.torus) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in self.torus):
            raise ConfigError(f"topology.torus = {list(self.torus)!r}: write torus = [x, y], two "
                              f"{'positive' if low else 'non-negative'} integers (a torus_2d needs it)")


def topology_from_dict(table: Any, source: str = "<dict>") -> TopologySpec:
    if not isinstance(table, dict):
        raise ConfigError(f"cluster file {source}: [topology] must be a table")
    known = {f.name for f in TopologySpec.__dataclass_fields__.values()}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"cluster file {source}: unknown key(s) topology.{', topology.'.join(unknown)}; known: "
                          f"{', '.join(sorted(known))}")
    values = dict(table)
    if "torus" in values:
        if not isinstance(values["torus"], (list, tuple)):  # a file's list, or ClusterSpec.to_dict()'s tuple
            raise ConfigError(f"cluster file {source}: topology.torus = {values['torus']!r}: write [x, y]")
        values["torus"] = tuple(values["torus"])
    return TopologySpec(**values)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    accelerator: Accelerator
    accelerators_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    nodes: int = 0  # 0: as many as the job needs
    source: str = ""  # where the figures come from
    host_bandwidth_gbs: float = 32.0  # accelerator <-> host memory per direction (PCIe), for offload
    nvme_bandwidth_gbs: float = 25.0  # a node's local drives (read or write), shared by its ranks, for NVMe offload
    collectives: dict[str, LinkSpec] = field(default_factory=dict)  # fitted native collectives inside a node
    topology: TopologySpec = field(default_factory=TopologySpec)  # the fabric, for the simulator
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)  # ranks' arrival skew at sync points (CPU hosts)

    def sync_delay(self, compute: float, ranks: int) -> float:
        """Seconds a blocking collective over `ranks` ranks waits beyond its priced time for the last of them, after
        `compute` seconds of compute since the previous sync point (0 without an [arrival] table). The measured
        wait is scaled from the ranks it spanned to `ranks` by the expected latest of that many independent
        normal arrivals (`expected_latest`): two ranks wait 0.55 times as long as four."""
        spec = self.arrival
        if not spec.measured or ranks < 2:
            return 0.0
        scale = expected_latest(ranks) / expected_latest(spec.ranks) if spec.ranks >= 2 else 1.0
        return scale * max(0.0, spec.at(compute) - spec.at(spec.after_us * 1e-6))

    def links(self) -> Cluster:
        """The alpha-beta cluster of comm/cost.py (gamma 0: reductions run at memory speed, hidden by the links)."""
        return self._links

    @cached_property
    def _links(self) -> Cluster:  # a search asks for links hundreds of thousands of times; the spec is frozen
        return Cluster(self.intra.link(), self.inter.link(), self.accelerators_per_node)

    @cached_property
    def _collective_links(self) -> dict[str, Link]:
        return {name: spec.link() for name, spec in self.collectives.items()}

    def link_for(self, span: int) -> Link:
        """The link pacing a collective whose ranks lie within `span` consecutive ranks."""
        return self._links.link_for(span)

    def collective_link(self, collective: str, span: int) -> Link:
        """The link pricing the backend's `collective` over ranks within `span` consecutive ranks: the
        collective's fitted link inside a node when the file has one, else the link pacing the span."""
        if collective in self.collectives and span <= self.accelerators_per_node:
            return self._collective_links[collective]
        return self._links.link_for(span)

    @property
    def memory_bytes(self) -> int:
        return int(self.accelerator.memory_gib * 2**30)

    def check_size(self, gpus: int) -> None:
        if self.nodes and gpus > self.nodes * self.accelerators_per_node:
            raise ConfigError(f"{gpus} accelerators do not fit cluster {self.name}: it has {self.nodes} nodes x "
                              f"{self.accelerators_per_node}; ask for fewer or describe a larger cluster")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The share of the data sheet's memory bandwidth PyTorch's memory-bound kernels reach, measured on an H200
# (2026-11-27, torch.profiler over training steps of 1.2B and 3.1B parameters: fused AdamW 0.70 and 0.73, the
# gradients' foreach norm 0.73 and 0.74, their foreach scaling 0.76 and 0.77, the MoE experts' bf16 stack copy
# 0.74; the median, 0.74) and taken for every GPU preset (measured on no other GPU)
STREAMING_SHARE = 0.74


def _gpu(name: str, memory_gib: float, hbm: float, fp32: float, bf16: float, fp8: float, nvlink: float, nic: float,
         pcie: float, source: str) -> ClusterSpec:
    return ClusterSpec(name, Accelerator(name, memory_gib, {"fp32": fp32, "bf16": bf16, "fp8": fp8} if fp8 else
                                         {"fp32": fp32, "bf16": bf16}, hbm, memory_efficiency=STREAMING_SHARE),
                       8, LinkSpec(nvlink, 3.0), LinkSpec(nic, 6.0), source=source, host_bandwidth_gbs=pcie)


# Data-sheet figures per GPU: dense FP32 (no TF32), dense BF16 and FP8 tensor-core TFLOP/s; memory;
# NVLink bandwidth per direction (half the bidirectional total); one InfiniBand NIC per GPU.
PRESETS: dict[str, ClusterSpec] = {
    "a100-80gb": _gpu("A100-80GB", 80, 2039.0, 19.5, 312.0, 0, 300.0, 25.0, 32.0,
                      "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): 2,039 GB/s HBM2e, 19.5 TF FP32, 312 TF BF16, NVLink 600 GB/s; "
                      "DGX A100: 8 x 200 Gb/s HDR InfiniBand"),
    "h100-sxm": _gpu("H100-SXM", 80, 3350.0, 67.0, 989.5, 1979.0, 450.0, 50.0, 64.0,
                     "NVIDIA H100 Tensor Core GPU data sheet (SXM5): 3.35 TB/s HBM3, 67 TF FP32, 989.5 TF BF16, 1,979 TF FP8 (dense), "
                     "NVLink 900 GB/s; DGX H100: 8 x 400 Gb/s NDR InfiniBand"),
    "h200": _gpu("H200", 141, 4800.0, 67.0, 989.5, 1979.0, 450.0, 50.0, 64.0,
                 "NVIDIA H200 Tensor Core GPU data sheet (SXM): 141 GB HBM3e at 4.8 TB/s, compute as H100 SXM, NVLink 900 GB/s; "
                 "DGX H200: 8 x 400 Gb/s NDR InfiniBand"),
    "b200": _gpu("B200", 180, 8000.0, 80.0, 2250.0, 4500.0, 900.0, 50.0, 64.0,
                 "NVIDIA DGX B200 data sheet: 1,440 GB and 64 TB/s HBM3e over 8 GPUs, 72 PF FP8 training (sparse) = 4.5 PF dense per GPU, "
                 "2.25 PF dense BF16, NVLink 5 1.8 TB/s per GPU, 8 x 400 Gb/s ConnectX-7"),
}


def _section(data: dict, key: str, source: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ConfigError(f"cluster file {source}: missing table [{key}]")
    return value


def _number(table: dict, key: str, where: str, positive: bool = True) -> float:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (value <= 0 if positive else value < 0):
        raise ConfigError(f"cluster file: {where}.{key} = {value!r}: must be a {'positive' if positive else 'non-negative'} "
                          "finite number")
    return float(value)


def _measured_points(ranks: Any, measured: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A collective's measured times: >= 2 [bytes, microseconds] pairs, bytes strictly increasing, over `ranks` >= 2."""
    usage = (f"cluster file: {where}: `measured` is a list of [bytes, microseconds] pairs with strictly increasing "
             "positive bytes and positive times, timed over `ranks` (an integer >= 2) ranks")
    if (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2 or not isinstance(measured, (list, tuple))
            or len(measured) < 2 or any(not isinstance(point, (list, tuple)) or len(point) != 2 for point in measured)):
        raise ConfigError(f"{usage}; found ranks = {ranks!r}, measured = {measured!r}")
    points = tuple((_number({"bytes": a}, "bytes", where), _number({"us": b}, "us", where)) for a, b in measured)
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise ConfigError(f"{usage}; found bytes {[size for size, _ in points]}")
    return points


def _collective_spec(table: dict, where: str) -> LinkSpec:
    """[collectives.<name>]: its fitted link, and optionally the times it was fitted to (`ranks`, `measured`) and
    its times over smaller groups of those ranks (`subgroups`)."""
    unknown = sorted(set(table) - {"bandwidth_gbs", "latency_us", "ranks", "measured", "subgroups"})
    if unknown:
        raise ConfigError(f"cluster file: {where} has unknown key(s) {', '.join(unknown)}; known: bandwidth_gbs, "
                          "latency_us, ranks, measured, subgroups")
    ranks, measured = table.get("ranks", 0), table.get("measured", [])
    points = _measured_points(ranks, measured, where) if ranks or measured else ()
    groups, listed = [], table.get("subgroups", [])
    usage = (f"cluster file: {where}: `subgroups` is a list of tables {{ranks = q, measured = [[bytes, us], ...]}}, "
             f"each q >= 2 a divisor of `ranks` below it, once each, beside the collective's own `ranks` and `measured`")
    if listed and (not points or not isinstance(listed, (list, tuple))):
        raise ConfigError(f"{usage}; found subgroups = {listed!r} with ranks = {ranks!r}")
    for entry in listed:
        if not isinstance(entry, dict) or set(entry) != {"ranks", "measured"}:
            raise ConfigError(f"{usage}; found {entry!r}")
        q = entry["ranks"]
        group = SubgroupTimes(q, _measured_points(q, entry["measured"], f"{where}, subgroups"))
        if q >= ranks or ranks % q or any(g.ranks == q for g in groups):
            raise ConfigError(f"{usage}; found ranks = {q!r} in a link measured over {ranks} ranks")
        groups.append(group)
    return LinkSpec(_number(table, "bandwidth_gbs", where), _number(table, "latency_us", where, positive=False),
                    ranks if points else 0, points, tuple(groups))


def cluster_from_dict(data: dict[str, Any], source: str = "<dict>") -> ClusterSpec:
    """A ClusterSpec from a parsed cluster file, every field validated with a message naming it."""
    known = {"name", "accelerators_per_node", "nodes", "accelerator", "intra", "inter", "source", "host_bandwidth_gbs",
             "nvme_bandwidth_gbs", "collectives", "topology", "arrival"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"cluster file {source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    acc = _section(data, "accelerator", source)
    accelerator_keys = {f.name for f in fields(Accelerator)}
    if set(acc) - accelerator_keys:
        raise ConfigError(f"cluster file {source}: unknown accelerator key(s) {', '.join(sorted(set(acc) - accelerator_keys))}; "
                          f"known: {', '.join(sorted(accelerator_keys))}")
    tflops = acc.get("tflops")
    if not isinstance(tflops, dict) or not tflops:
        raise ConfigError(f"cluster file {source}: accelerator.tflops must be a table of dtype = TFLOP/s, e.g. "
                          "{fp32 = 67, bf16 = 989.5}")
    rates = {str(k): _number(tflops, k, "accelerator.tflops") for k in tflops}
    per_node = data.get("accelerators_per_node")
    nodes = data.get("nodes", 0)
    for key, value, low in (("accelerators_per_node", per_node, 1), ("nodes", nodes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"cluster file {source}: {key} = {value!r}: must be an integer >= {low}")
    links = {}
    for key in ("intra", "inter"):
        table = _section(data, key, source)
        links[key] = LinkSpec(_number(table, "bandwidth_gbs", key), _number(table, "latency_us", key, positive=False))
    bandwidth = _number(acc, "memory_bandwidth_gbs", "accelerator", positive=False) if "memory_bandwidth_gbs" in acc else 0.0
    overhead = _number(acc, "pass_overhead_us", "accelerator", positive=False) if "pass_overhead_us" in acc else 0.0
    shared = acc.get("shared_cores", 0)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"cluster file {source}: accelerator.shared_cores = {shared!r}: must be an integer >= 0 "
                          "(a CPU host's cores its ranks share; 0 for accelerators)")
    oversubscribed = _number(acc, "oversubscribed_efficiency", "accelerator") if "oversubscribed_efficiency" in acc else 1.0
    if oversubscribed > 1:
        raise ConfigError(f"cluster file {source}: accelerator.oversubscribed_efficiency = {oversubscribed!r}: must be in "
                          "(0, 1] (a host's throughput with more threads than cores, over with as many)")
    streaming = _number(acc, "memory_efficiency", "accelerator") if "memory_efficiency" in acc else 1.0
    if streaming > 1:
        raise ConfigError(f"cluster file {source}: accelerator.memory_efficiency = {streaming!r}: must be in (0, 1] (the "
                          "share of memory_bandwidth_gbs memory-bound kernels reach; 1 where that figure is measured)")
    optimizer = {key: _number(acc, key, "accelerator", positive=False) if key in acc else 0.0
                 for key in ("optimizer_gbs", "optimizer_tensor_us", "p2p_post_us", "p2p_post_gbs", "ring_step_operators",
                             "expert_group_us")}
    codecs = {key: _codec_rates(acc, key, source) for key in ("codec_ns", "codec_encode_ns")}
    for name, ns in codecs["codec_encode_ns"].items():
        if ns > codecs["codec_ns"].get(name, math.inf):
            raise ConfigError(f"cluster file {source}: accelerator.codec_encode_ns.{name} = {ns!r} exceeds codec_ns.{name} "
                              "(the compression is part of the bucket's reduction)")
    collectives = data.get("collectives", {})
    if not isinstance(collectives, dict) or any(k not in NATIVE_COLLECTIVES or not isinstance(v, dict)
                                                for k, v in collectives.items()):
        raise ConfigError(f"cluster file {source}: [collectives] holds tables named {', '.join(NATIVE_COLLECTIVES)}, "
                          f"each with bandwidth_gbs and latency_us; found {collectives!r}")
    fitted = {k: _collective_spec(v, f"collectives.{k}") for k, v in collectives.items()}
    return ClusterSpec(str(data.get("name", Path(source).stem)),
                       Accelerator(str(acc.get("name", "accelerator")), _number(acc, "memory_gib", "accelerator"), rates,
                                   bandwidth, overhead, shared, oversubscribed, **optimizer, **codecs,
                                   memory_efficiency=streaming),
                       per_node, links["intra"], links["inter"], nodes, str(data.get("source", source)),
                       _number(data, "host_bandwidth_gbs", "(top level)") if "host_bandwidth_gbs" in data else 32.0,
                       _number(data, "nvme_bandwidth_gbs", "(top level)") if "nvme_bandwidth_gbs" in data else 25.0,
                       fitted, topology_from_dict(data.get("topology", {}), source),
                       arrival_from_dict(data.get("arrival", {}), source))


def arrival_from_dict(table: Any, source: str = "<dict>") -> ArrivalSpec:
    """[arrival] (or `comm/bench.py measure_arrival`'s dict): after_us, ranks and measured = [[us of compute, us],
    ...], compute strictly increasing from >= 0; an empty table or measured list is no skew."""
    usage = (f"cluster file {source}: [arrival] holds after_us (>= 0), ranks and measured, a list of at least two "
             "[microseconds of compute, microseconds] pairs with compute strictly increasing from >= 0 and times >= 0")
    if not isinstance(table, dict) or set(table) - {"after_us", "measured", "ranks"}:
        raise ConfigError(f"{usage}; found {table!r}")
    measured = table.get("measured")
    if not measured and measured is not None or not table:  # none measured (a ClusterSpec.to_dict() writes [])
        return ArrivalSpec()
    if not isinstance(measured, (list, tuple)) or len(measured) < 2 or any(
            not isinstance(point, (list, tuple)) or len(point) != 2 for point in measured):
        raise ConfigError(f"{usage}; found measured = {measured!r}")
    points = tuple((_number({"compute": a}, "compute", "arrival.measured", positive=False),
                    _number({"us": b}, "us", "arrival.measured", positive=False)) for a, b in measured)
    if points[0][0] < 0 or any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise ConfigError(f"{usage}; found compute {[c for c, _ in points]}")
    after = _number(table, "after_us", "arrival", positive=False) if "after_us" in table else 0.0
    ranks = table.get("ranks", 0)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks == 1 or ranks < 0:
        raise ConfigError(f"{usage}, and ranks (the ranks it spanned: an integer >= 2, or 0 for unknown); "
                          f"found ranks = {ranks!r}")
    return ArrivalSpec(after, points, ranks)


def _codec_rates(acc: dict, key: str, source: str) -> dict[str, float]:
    """accelerator.codec_ns / codec_encode_ns: a table of codec = ns per value, codecs named as gradient_comm.compression."""
    table = acc.get(key, {})
    names = tuple(CODEC_BYTES)
    if not isinstance(table, dict) or set(table) - set(names):
        raise ConfigError(f"cluster file {source}: accelerator.{key} must be a table of codec = ns per gradient value "
                          f"for codecs among {', '.join(names)}; found {table!r}")
    return {str(k): _number(table, k, f"accelerator.{key}", positive=False) for k in table}


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name (a100-80gb, h100-sxm, h200, b200) or a cluster TOML file."""
    if name_or_path.lower() in PRESETS:
        return PRESETS[name_or_path.lower()]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--cluster {name_or_path}: neither a preset ({', '.join(PRESETS)}) nor a file; "
                          "`fivefold bench comm --cluster-file FILE` writes one for this machine")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from exc
    return cluster_from_dict(data, str(path))


def _subgroup_toml(group: SubgroupTimes) -> str:
    return f"{{ranks = {group.ranks}, measured = {json.dumps([list(point) for point in group.measured])}}}"


def cluster_toml(spec: ClusterSpec) -> str:
    """The TOML form `load_cluster` reads back."""
    acc, intra, inter = spec.accelerator, spec.intra, spec.inter
    rates = ", ".join(f"{k} = {v!r}" for k, v in acc.tflops.items())
    return "\n".join([
        f"name = {json.dumps(spec.name)}",
        f"accelerators_per_node = {spec.accelerators_per_node}",
        f"nodes = {spec.nodes}",
        f"source = {json.dumps(spec.source)}",
        f"host_bandwidth_gbs = {spec.host_bandwidth_gbs!r}",
        f"nvme_bandwidth_gbs = {spec.nvme_bandwidth_gbs!r}",
        "", "[accelerator]", f"name = {json.dumps(acc.name)}", f"memory_gib = {acc.memory_gib!r}", f"tflops = {{{rates}}}",
        f"memory_bandwidth_gbs = {acc.memory_bandwidth_gbs!r}",
        f"memory_efficiency = {acc.memory_efficiency!r}",
        f"pass_overhead_us = {acc.pass_overhead_us!r}",
        f"shared_cores = {acc.shared_cores!r}",
        f"oversubscribed_efficiency = {acc.oversubscribed_efficiency!r}",
        f"optimizer_gbs = {acc.optimizer_gbs!r}",
        f"optimizer_tensor_us = {acc.optimizer_tensor_us!r}",
        f"p2p_post_us = {acc.p2p_post_us!r}",
        f"p2p_post_gbs = {acc.p2p_post_gbs!r}",
        f"ring_step_operators = {acc.ring_step_operators!r}",
        f"expert_group_us = {acc.expert_group_us!r}",
        *(f"{key} = {{{', '.join(f'{k} = {v!r}' for k, v in table.items())}}}"
          for key, table in (("codec_ns", acc.codec_ns), ("codec_encode_ns", acc.codec_encode_ns)) if table),
        "", "[intra]", f"bandwidth_gbs = {intra.bandwidth_gbs!r}", f"latency_us = {intra.latency_us!r}",
        "", "[inter]", f"bandwidth_gbs = {inter.bandwidth_gbs!r}", f"latency_us = {inter.latency_us!r}", "",
        *(line for name, link in spec.collectives.items()
          for line in (f"[collectives.{name}]", f"bandwidth_gbs = {link.bandwidth_gbs!r}",
                       f"latency_us = {link.latency_us!r}",
                       *((f"ranks = {link.ranks}", f"measured = {json.dumps([list(point) for point in link.measured])}")
                         if link.measured else ()),
                       *((f"subgroups = [{', '.join(_subgroup_toml(g) for g in link.subgroups)}]",)
                         if link.subgroups else ()), "")),
        "[topology]", *(f"{key} = {json.dumps(list(value) if isinstance(value, tuple) else value)}"
                        for key, value in asdict(spec.topology).items()), "",
        *(("[arrival]", f"after_us = {spec.arrival.after_us!r}", f"ranks = {spec.arrival.ranks}",
           f"measured = {json.dumps([list(point) for point in spec.arrival.measured])}", "")
          if spec.arrival.measured else ()),
    ])
