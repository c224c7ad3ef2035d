"""The planner's predicted and the simulator's step time against the trainer's measured one, layout by layout,
on this machine.

For each world size the ranks first describe this machine as the planner sees it: links fitted by
ping-pong (comm/measure.py) and each gloo collective's own link (comm/bench.py measure_native_links,
at the sizes a step sends; measured again in each batch with its trainers alive, the median alpha and
beta over batches, and each size's median time, which the planner interpolates at this world size; on 4 ranks
also over pairs of ranks, both pairs calling at once, read for a layout's groups of 2), and
the ranks' arrival skew (comm/bench.py measure_arrival: a tiny all-reduce after 0-20 ms of compute, the
median per burst over batches; the cluster's [arrival]) and the time a rank's thread spends posting a ring
exchange beside compute (measure_post, the median per size over batches; accelerator.p2p_post_us) and ring
attention's own Python per ring step (plan/ring_host.py, the median over batches of the ranks' mean;
accelerator.ring_step_operators) and, at every world size, the grouped GEMM's fixed cost per expert
(plan/expert_host.py, the same way; accelerator.expert_group_us). Then, in batches of --batch layouts (their trainers alive together and
freed before the next batch: a score of live trainers slows every step by a quarter or more), every
layout builds the real Trainer (configs/tiny.toml's model on the
embedded corpus, shrunk by the options), takes warm-up steps, and is timed in rotating rounds: one step
of each layout per round, the order rotated, and the matmul rate, memory bandwidth and the runtime's
AdamW rate (per parameter and per tensor) each rank achieves while the others compute too (comm/bench.py
matmul_tflops, memory_gbs, optimizer_rate) measured again each round, the gradient codecs' local work
(codec_rates, on the model's own parameter shapes) in each round of a batch holding a compressed layout, and, where the ranks' threads outnumber the cores, the
matmul rate with only as many ranks computing as the cores hold (the cluster's oversubscribed_efficiency; its shared_cores are this
machine's: ranks idle in a pipeline bubble lend their cores); a layout's time is the median over
rounds of its slowest rank's step. Rounds put a slow spell of
this shared machine on every layout of a batch alike; a control, a trainer of the world size's first layout alive
through every batch and timed in each round too, measures each batch's spell (its median step there over its median
across batches, `batch_factors`), and each layout's step is divided by its batch's (`--no-control`: not). The planner predicts each config on that cluster with
compute constants fitted on the one-rank layouts only (`fit_compute`): the achieved share of the
matmul rate (--efficiency), one per compute dtype (fp32, and bf16 on `single-bf16`), and a block pass's
fixed host cost (accelerator.pass_overhead_us; one thread's work, so it grows by ranks / cores once the
ranks outnumber the cores) on the dense ones, then the routed experts' share (--expert-efficiency) on
`single-moe`. Every multi-rank
layout is predicted with no further fitting, so those rows check everything the planner adds:
parallel splits, communication, recomputation, the pipeline bubble.

    python benchmarks/plan_vs_measured.py                    # the table of docs/planner.md
    python benchmarks/plan_vs_measured.py --steps 2 --quick  # a few layouts (the test's run)
    python benchmarks/plan_vs_measured.py --replay rows.json # predict an earlier run's --json again
    python benchmarks/plan_vs_measured.py --replay rows.json --fidelity flow  # ... simulating at flow level
    python benchmarks/plan_vs_measured.py --only single,ep2  # the named layouts only
    python benchmarks/plan_vs_measured.py --rates passes     # priced with the rates shared_rates.py carries
    python benchmarks/plan_repeatability.py A.json B.json ...  # several runs' --json together (each layout's
    #   median error over the runs, and how far the measured steps repeat between them)

Each round also times the fp32 matmul rate per rank over equal work between barriers (comm/bench.py
matmul_tflops_together), beside the slowest rank's rate it prices with; both are printed per world size and
stored (`fp32_tflops`, `fp32_tflops_together`), not priced. So are rank 0's measurements alone on every core that
each round takes for shared_rates.py (its fp32 matmul rate and the reference model's pass: `alone_fp32_tflops`,
`alone_pass_s`, medians over the world size's rounds): the host's speed while each world size was timed, the same
work in every phase, so that a run's drift between world sizes can be told from the host's (recorded since
2026-11-29 afternoon, not priced).

Each round also times rank 0 alone and a transformer's passes on every rank (shared_rates.py), so every run
predicts the same steps with a second set of compute rates and prints that set's summary (`# with the ...
rates instead`): the square matmul loop's by default, the passes' with --rates passes.

The rates are priced as medians over the whole run's rounds; every run also predicts each layout at the
medians of its own batch's rounds only (the rates measured while it was timed) and prints that summary too (`#
with the rates of each layout's own batch ...`; stored per row as `cluster_batch`). Each batch's own times of the
backend's collectives are stored as well (`native_batches`), so a replay can read them another way.

Prints one row per layout (predicted, measured, error) and
RESULT name=plan_vs_measured layouts=N efficiency=... efficiency_bf16=... expert_ratio=... overhead_us=... median_abs_error=...
       multi_rank_median_abs_error=... within_10pct=... worst_abs_error=... kendall_tau=... best_gap=...
       sim_median_abs_error=... sim_worst_abs_error=... sim_within_10pct=...
(the sim_ figures: `fivefold simulate`'s step, sim/step.py at --fidelity, default hybrid as the command's, on
the same fitted cluster and efficiency: the same compute model, the runtime's own collectives and their
overlap played out; on one host hybrid plays each gloo collective for its measured time, flow as a ring's
messages on the ping-pong links)
(Kendall's tau between the predicted and measured order of the layouts of the largest world size,
and how much slower the predicted best measures than the measured best).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fivefold.sim.names import FIDELITIES  # noqa: E402  (torch-free: a bad argument is refused before torch loads)

ROOT = Path(__file__).parent.parent

# (world size, name, overrides): every fold of the runtime, on 1, 2 and 4 ranks
LAYOUTS = [
    (1, "single", []),
    (1, "single-selective", ["--train.recompute", "selective"]),
    (1, "single-full", ["--train.recompute", "full"]),
    (1, "single-accum2", ["--train.grad_accum_steps", "2"]),
    (1, "single-micro2x2", ["--train.micro_batch_size", "2", "--train.grad_accum_steps", "2"]),
    (2, "dp2", []),
    (2, "dp2-zero1", ["--data_parallel.zero_stage", "1", "--data_parallel.shard", "2"]),
    (2, "dp2-zero2", ["--data_parallel.zero_stage", "2", "--data_parallel.shard", "2"]),
    (2, "dp2-zero3", ["--data_parallel.zero_stage", "3", "--data_parallel.shard", "2"]),
    (2, "tp2", ["--tensor_parallel.degree", "2"]),
    (2, "tp2-sp", ["--tensor_parallel.degree", "2", "--tensor_parallel.sequence_parallel", "true"]),
    (2, "cp2-ring", ["--context_parallel.degree", "2"]),
    (2, "pp2-1f1b", ["--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "4"]),
    (2, "pp2-gpipe", ["--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "gpipe", "--train.grad_accum_steps", "4"]),
    (2, "pp2-zbh1", ["--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "zb-h1", "--train.grad_accum_steps", "4"]),
    (2, "dp2-full", ["--train.recompute", "full"]),
    (4, "dp4", []),
    (4, "dp4-zero3", ["--data_parallel.zero_stage", "3", "--data_parallel.shard", "4"]),
    (4, "dp2-tp2", ["--tensor_parallel.degree", "2"]),
    (4, "tp4", ["--tensor_parallel.degree", "4"]),
    (4, "dp2-pp2", ["--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "4"]),
    (4, "pp4", ["--pipeline_parallel.degree", "4", "--train.grad_accum_steps", "8"]),
    (4, "dp2-pp2-interleaved", ["--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "interleaved",
                                "--pipeline_parallel.virtual", "2", "--train.grad_accum_steps", "4",
                                "--data_parallel.replicate", "2"]),
    (4, "dp2-cp2", ["--context_parallel.degree", "2"]),
    (4, "tp2-pp2", ["--tensor_parallel.degree", "2", "--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "4"]),
    (1, "single-seq256", ["--train.seq_len", "256"]),
    (1, "single-micro8", ["--train.micro_batch_size", "8"]),
    (1, "single-micro8-full", ["--train.micro_batch_size", "8", "--train.recompute", "full"]),
    (1, "single-6-layers", ["--model.n_layers", "6"]),
    # bf16 compute (autocast): the one-rank row anchors the bf16 share of the bf16 matmul rate, the others check it
    (1, "single-bf16", ["--train.dtype", "bf16"]),
    (2, "dp2-bf16", ["--train.dtype", "bf16"]),
    (2, "dp2-seq256", ["--train.seq_len", "256"]),
    (2, "dp2-accum2", ["--train.grad_accum_steps", "2"]),
    (2, "dp2-selective", ["--train.recompute", "selective"]),
    (2, "dp2-zero3-bf16", ["--data_parallel.zero_stage", "3", "--data_parallel.shard", "2", "--data_parallel.param_dtype", "bf16"]),
    (2, "tp2-full", ["--tensor_parallel.degree", "2", "--train.recompute", "full"]),
    (2, "cp2-ulysses", ["--context_parallel.degree", "2", "--context_parallel.method", "ulysses"]),
    (2, "pp2-1f1b-m8", ["--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "8", "--train.micro_batch_size", "2"]),
    (2, "pp2-interleaved", ["--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "interleaved",
                            "--pipeline_parallel.virtual", "2", "--train.grad_accum_steps", "4"]),
    (4, "dp4-zero1", ["--data_parallel.zero_stage", "1", "--data_parallel.shard", "4"]),
    (4, "dp4-zero2", ["--data_parallel.zero_stage", "2", "--data_parallel.shard", "4"]),
    (4, "dp4-full", ["--train.recompute", "full"]),
    (4, "dp4-selective", ["--train.recompute", "selective"]),
    (4, "dp4-micro2", ["--train.micro_batch_size", "2"]),
    (4, "dp2-tp2-sp", ["--tensor_parallel.degree", "2", "--tensor_parallel.sequence_parallel", "true"]),
    (4, "dp2-tp2-zero1", ["--tensor_parallel.degree", "2", "--data_parallel.zero_stage", "1", "--data_parallel.shard", "2"]),
    (4, "cp4-ring", ["--context_parallel.degree", "4"]),
    (4, "cp2-tp2", ["--context_parallel.degree", "2", "--tensor_parallel.degree", "2"]),
    (4, "pp4-gpipe", ["--pipeline_parallel.degree", "4", "--pipeline_parallel.schedule", "gpipe", "--train.grad_accum_steps", "8"]),
    (4, "pp4-zbh1", ["--pipeline_parallel.degree", "4", "--pipeline_parallel.schedule", "zb-h1", "--train.grad_accum_steps", "8"]),
    (4, "dp2-pp2-zbh1", ["--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "zb-h1", "--train.grad_accum_steps", "4"]),
    (4, "dp2-pp2-zero1", ["--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "4", "--data_parallel.zero_stage", "1",
                          "--data_parallel.shard", "2"]),
    # the pipeline inside data parallelism (ranks 0, 1 one pipeline): on one host every group shares its links
    (4, "dp2-pp2-inner", ["--pipeline_parallel.degree", "2", "--train.grad_accum_steps", "4",
                          "--pipeline_parallel.placement", "inner"]),
    (4, "dp2-cp2-zero3", ["--context_parallel.degree", "2", "--data_parallel.zero_stage", "3", "--data_parallel.shard", "2"]),
    # priority scheduling of the gradient slices (P3): no global clipping, updates deferred to the next forward
    (2, "dp2-priority", ["--gradient_comm.schedule", "priority", "--train.max_grad_norm", "0"]),
    (4, "dp4-priority", ["--gradient_comm.schedule", "priority", "--train.max_grad_norm", "0"]),
    (4, "dp4-unclipped", ["--train.max_grad_norm", "0"]),
    # gradient compression: each codec's messages (and its elementwise work on the communication thread)
    (2, "dp2-int8", ["--gradient_comm.compression", "int8"]),
    (2, "dp2-sign", ["--gradient_comm.compression", "sign"]),
    (2, "dp2-topk", ["--gradient_comm.compression", "topk"]),
    (2, "dp2-powersgd", ["--gradient_comm.compression", "powersgd"]),
    # mixture of experts (tiny-moe: 8 experts, top-2, one shared expert), experts split by expert parallelism
    (1, "single-moe", ["--model.preset", "tiny-moe"]),
    (2, "dp2-moe", ["--model.preset", "tiny-moe"]),
    (2, "ep2", ["--model.preset", "tiny-moe", "--expert_parallel.degree", "2"]),
    (4, "ep4", ["--model.preset", "tiny-moe", "--expert_parallel.degree", "4"]),
    (4, "dp2-ep2", ["--model.preset", "tiny-moe", "--expert_parallel.degree", "2"]),
]
QUICK = {"single", "single-full", "dp2", "tp2", "pp2-1f1b"}
# parameter servers: their ranks take roles (the servers answer pushes and pulls until the workers' last step), so
# each runs alone as a `fivefold train` job after its world size's batches, on that world size's fitted cluster
SOLO = [
    (4, "ps3-bsp", ["--data_parallel.mode", "ps"]),
    (4, "ps2-servers2-bsp", ["--data_parallel.mode", "ps", "--parameter_server.servers", "2"]),
]


def _measure(rank: int, world_size: int, job) -> dict:
    """On every rank: fit the links, then time the layouts' steps in batches of `batch` layouts (their trainers
    alive together, freed before the next batch: many live trainers slow every step), each batch in rotating
    rounds (one step of each layout per round, the order rotated, the matmul rate, memory bandwidth and AdamW
    rate measured again each round) so that a slow spell of this shared machine lands on the layouts and rates
    alike; medians over rounds."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    from fivefold.comm.bench import (codec_rates, fit_post, matmul_tflops, matmul_tflops_together, measure_arrival,
                                     measure_expert_groups_here, measure_native_links, measure_post,
                                     measure_ring_host_here, memory_gbs, optimizer_rate, oversubscribed_share,
                                     ranks_fitting)
    from fivefold.comm.measure import measure_cluster
    from fivefold.comm.p2p import Ranks
    from shared_rates import alone_measurements, shared_rates
    from fivefold.train.trainer import Trainer

    import gc

    configs, steps, warmup, batch, control = job
    cores = os.cpu_count() or 1
    threads = max(1, cores // world_size)
    torch.set_num_threads(threads)
    links = measure_cluster(Ranks.world(), world_size) if world_size > 1 else None
    natives: list[dict] = []  # each gloo collective's fitted link, measured again with each batch's trainers alive,
    alone: list[dict] = []  # each call after a burst of compute (as a step makes them) and back to back (alone)
    arrivals: list[dict] = []  # a tiny all-reduce after bursts of compute (the cluster's [arrival]), each batch
    posts: list[dict] = []  # a ring exchange's post on the rank's thread, beside compute (p2p_post_us), each batch
    rings: list[float] = []  # ring attention's own Python per ring step (ring_step_operators), each batch
    groups: list[float] = []  # the grouped GEMM's fixed cost per expert and call (expert_group_us), each batch
    samples: dict[str, list[float]] = {name: [] for name, _ in configs}
    rates: dict[str, list[float]] = {"fp32": [], "bf16": []}  # a square matmul loop on every rank at once
    together: list[float] = []  # its fp32 rate per rank over equal work between barriers (recorded, not priced)
    fitting: list[float] = []  # its fp32 rate with only as many ranks computing as the cores hold
    carried: dict[str, list[float]] = {"fp32": [], "bf16": []}  # rank 0's alone, carried by passes (shared_rates.py)
    efficiencies: list[float] = []  # the oversubscribed efficiency from the same passes
    lone: list[tuple[float, float]] = []  # rank 0 alone on every core: (fp32 matmul TFLOP/s, reference pass seconds)
    bandwidths = []
    optimizer: list[tuple[float, float]] = []  # the runtime's AdamW: (GB/s of 28 bytes per parameter, us per tensor)
    codecs: list[tuple[dict, dict]] = []  # the gradient codecs' local work, ns per value (comm/bench.py codec_rates)
    round_batch: list[int] = []  # each round's batch (each layout is also predicted at its own batch's rates)
    batch_of: dict[str, int] = {}
    # the control: a trainer of the world's first layout, alive through every batch and timed in each round with
    # the batch's layouts, so each batch's slow or fast spell is measured on the same work (`batch_factors`)
    reference = Trainer(dataclasses.replace(configs[0][1], train=dataclasses.replace(
        configs[0][1].train, output_dir=f"{configs[0][1].train.output_dir}-reference"))) \
        if control and len(configs) > batch else None
    reference_samples: list[list[float]] = []
    for _ in range(warmup if reference else 0):
        reference.train_step()
    for first in range(0, len(configs), batch):
        trainers = {name: Trainer(config) for name, config in configs[first:first + batch]}
        for trainer in trainers.values():
            for _ in range(warmup):
                trainer.train_step()
        if world_size > 1:
            natives.append(measure_native_links(torch.device("cpu"), beside_compute=True))
            alone.append(measure_native_links(torch.device("cpu")))
            arrivals.append(measure_arrival(torch.device("cpu")))
            posts.append(measure_post(torch.device("cpu")))
            rings.append(measure_ring_host_here()["ring_step_operators"])
        groups.append(measure_expert_groups_here()["expert_group_us"])  # with the batch's trainers alive
        compressed = [t for t in trainers.values() if t.config.gradient_comm.compression != "none"] if world_size > 1 else []
        names = list(trainers)
        batch_of.update((name, first // batch) for name in names)
        if reference:
            trainers[REFERENCE] = reference
            names.append(REFERENCE)
            samples[REFERENCE] = []
        for round_ in range(steps):
            round_batch.append(first // batch)
            if compressed:  # on the job's own parameters' shapes, with the batch's trainers alive; every round, as the
                # rates below: one timing can land on a slow spell (sign 79 ns a value once, 30 on the run before)
                codecs.append(codec_rates(torch.device("cpu"), list(compressed[0].model.parameters()), seconds=0.15))
            by_one, one_pass = alone_measurements(torch.device("cpu"), cores)
            lone.append((by_one["fp32"], one_pass))
            shared, efficiency = shared_rates(cores, threads, by_one, one_pass) \
                if world_size > 1 else (by_one, 1.0)
            efficiencies.append(efficiency)
            for dtype in rates:
                carried[dtype].append(shared[dtype])
                rates[dtype].append(matmul_tflops(dtype, torch.device("cpu"), seconds=0.2))
            together.append(matmul_tflops_together("fp32", torch.device("cpu"), rates["fp32"][-1]))
            if world_size * threads > cores:
                fitting.append(matmul_tflops("fp32", torch.device("cpu"), seconds=0.2, computing=ranks_fitting(cores, threads)))
            bandwidths.append(memory_gbs(torch.device("cpu"), seconds=0.2))
            optimizer.append(optimizer_rate(torch.device("cpu"), seconds=0.15))
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                trainers[name].train_step()
                elapsed = torch.tensor(time.perf_counter() - start)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                samples[name].append(float(elapsed))
        if reference:
            reference_samples.append(samples.pop(REFERENCE))
            del trainers[REFERENCE]
        for trainer in trainers.values():  # its process groups too: kept, they slow every later step
            trainer.close()
        trainers.clear()
        gc.collect()
    if reference:
        reference.close()

    def rates_over(kept: set[int]) -> dict:
        """The compute rates' medians over the rounds of the batches `kept`."""
        def median(values):
            return statistics.median(v for v, b in zip(values, round_batch) if b in kept)
        return {"rates": {dtype: median(values) for dtype, values in rates.items()},
                "together_tflops": median(together),
                "passes_rates": {dtype: median(values) for dtype, values in carried.items()},
                "passes_oversubscribed_efficiency": median(efficiencies),
                "alone_fp32_tflops": median([rate for rate, _ in lone]),
                "alone_pass_s": median([seconds for _, seconds in lone]),
                "memory_gbs": median(bandwidths),
                "optimizer_gbs": median([g for g, _ in optimizer]),
                "optimizer_tensor_us": median([u for _, u in optimizer]),
                "oversubscribed_efficiency": oversubscribed_share(world_size, median(rates["fp32"]),
                                                                  ranks_fitting(cores, threads), median(fitting))
                if fitting else 1.0}

    def median_times(points_per_batch: list[tuple]) -> list[tuple[float, float]]:
        """Each size's median time over the batches' (bytes, seconds) points."""
        return [(size, statistics.median(points[i][1] for points in points_per_batch))
                for i, (size, _) in enumerate(points_per_batch[0])]

    return {"links": dataclasses.asdict(links) if links else None,
            **{key: {name: {"alpha": statistics.median(n[name].alpha for n in fits),
                            "beta": statistics.median(n[name].beta for n in fits), "ranks": world_size,
                            "measured": median_times([n[name].measured for n in fits]),
                            "subgroups": [(q, median_times([dict(n[name].subgroups)[q] for n in fits]))
                                          for q, _ in fits[0][name].subgroups]}
                     for name in fits[0]} if fits else {}
               for key, fits in (("native", natives), ("native_alone", alone))},
            "native_batches": [{name: link.measured for name, link in n.items()} for n in natives],
            "arrival": {**arrivals[0], "measured": [[c, statistics.median(a["measured"][i][1] for a in arrivals)]
                                                     for i, (c, _) in enumerate(arrivals[0]["measured"])]}
            if arrivals else {},
            "post": fit_post([[size, statistics.median(p["measured"][i][1] for p in posts)]
                              for i, (size, _) in enumerate(posts[0]["measured"])]) if posts else {},
            "ring_step_operators": statistics.median(rings) if rings else 0.0,
            "expert_group_us": statistics.median(groups) if groups else 0.0,
            **rates_over(set(round_batch)), "batches": [rates_over({b}) for b in sorted(set(round_batch))],
            "batch_of": batch_of,
            **{key: {name: statistics.median(c[i][name] for c in codecs) for name in codecs[0][i]} if codecs else {}
               for i, key in enumerate(("codec_ns", "codec_encode_ns"))},
            **corrected_times({name: statistics.median(values) for name, values in samples.items()}, batch_of,
                              batch_factors([statistics.median(values) for values in reference_samples])),
            "cores": cores}


REFERENCE = "_reference"  # the control trainer's key among a batch's trainers


def batch_factors(reference_medians: list[float]) -> list[float]:
    """Each batch's slowness: the control's median step in that batch over the median of those medians (1.0 for
    every batch when there is no control or one batch). A shared machine's slow spell lasts minutes and lands on
    every layout of a batch alike (batch-mean errors of -21% and +18% in one run of 2026-11-29 05:41); the control
    runs the same work in every batch, so dividing a layout's step by its batch's factor leaves its time at the
    run's typical speed, the speed the run's median rates price."""
    if len(reference_medians) < 2:
        return [1.0] * len(reference_medians)
    if not all(math.isfinite(t) and t > 0 for t in reference_medians):
        raise ValueError(f"the control's median steps must be finite and positive, got {reference_medians}")
    typical = statistics.median(reference_medians)
    return [t / typical for t in reference_medians]


def corrected_times(raw: dict[str, float], batch_of: dict[str, int], factors: list[float]) -> dict:
    """{"times": each layout's step divided by its batch's factor, "raw_times": as measured, "batch_factor": the
    factor used}; a layout outside the batches (or with no factors) keeps its raw time, factor 1."""
    factor = {name: factors[batch_of[name]] if factors and name in batch_of else 1.0 for name in raw}
    return {"times": {name: t / factor[name] for name, t in raw.items()}, "raw_times": dict(raw),
            "batch_factor": factor}


def _measure_solo(world_size: int, name: str, argv: list[str], out_root: Path, timed: int, timeout: float) -> float:
    """A layout run alone by `fivefold train` on `world_size` ranks: the median of its last `timed` steps' seconds
    (each step's tokens over its logged tokens/s; every step logged)."""
    import subprocess

    out = out_root / name
    command = [sys.executable, "-m", "fivefold", "train", "--nproc-per-node", str(world_size), *argv,
               "--train.log_every", "1", "--train.output_dir", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{name}: fivefold train exited {done.returncode}: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    seconds = [(b["tokens_seen"] - a["tokens_seen"]) / b["tokens_per_s"] for a, b in zip(rows, rows[1:])]
    return statistics.median(seconds[-timed:])


def _cluster(world_size: int, measured: dict, collectives: str = "beside", rates: str = "matmul"):
    """This machine as the planner sees it; collectives: the backend's collectives as timed beside compute (a step's)
    or back to back (`alone`); rates: a square matmul loop's on every rank at once (`matmul`, as `fivefold bench
    comm` fits them) or one rank's alone carried to all by a transformer's passes (`passes`, shared_rates.py)."""
    from fivefold.plan.cluster import Accelerator, ArrivalSpec, ClusterSpec, LinkSpec, arrival_from_dict

    prefix = "passes_" if rates == "passes" else ""
    link = LinkSpec.from_fit(measured["links"]["intra"] if measured["links"] else {"alpha": 1e-6, "beta": 1e-9})
    return ClusterSpec(f"this machine, {world_size} ranks",
                       Accelerator("cpu rank", 8.0, measured[f"{prefix}rates"], measured["memory_gbs"],
                                   shared_cores=measured["cores"],
                                   oversubscribed_efficiency=measured[f"{prefix}oversubscribed_efficiency"],
                                   optimizer_gbs=measured["optimizer_gbs"], optimizer_tensor_us=measured["optimizer_tensor_us"],
                                   codec_ns=measured.get("codec_ns", {}), codec_encode_ns=measured.get("codec_encode_ns", {}),
                                   p2p_post_us=measured.get("post", {}).get("p2p_post_us", 0.0),
                                   p2p_post_gbs=measured.get("post", {}).get("p2p_post_gbs", 0.0),
                                   ring_step_operators=measured.get("ring_step_operators", 0.0),
                                   expert_group_us=measured.get("expert_group_us", 0.0)),
                       max(world_size, 1), link, link,
                       collectives={name: LinkSpec.from_fit(native) for name, native in
                                    measured.get("native" if collectives == "beside" else "native_alone", {}).items()},
                       arrival=arrival_from_dict(measured.get("arrival", {})) if collectives == "beside" else ArrivalSpec())


def _profiled(rows: list[dict], shares: dict[str, float]) -> None:
    """Predict every layout whose ranks' threads fit the cores again with its forward passes measured (`fivefold
    bench compute`: plan/profile.py, one rank alone at the job's shape and the threads a rank of it gets) instead
    of modelled, and print both errors: measured by as many processes at once as the layout has ranks
    (`measure_on_ranks`: they share the cores and memory as the ranks do). Layouts with more threads than cores
    are left out (the planner's core sharing takes rates measured that way, which these are not)."""
    from fivefold.errors import ConfigError
    from fivefold.plan.estimate import estimate
    from fivefold.plan.profile_measure import measure_on_ranks
    from fivefold.sim.step import simulate_step

    print("# with measured forward passes (plan/profile.py), ranks whose threads fit the cores:")
    print(f"# {'layout':<18}{'ranks':>6}{'profiled(s)':>13}{'simulated(s)':>14}{'measured(s)':>13}{'model err':>11}"
          f"{'profile err':>13}{'sim err':>9}")
    errors, model_errors, sim_errors = [], [], []
    for row in rows:
        threads = max(1, row["cores"] // row["world_size"])
        if row["world_size"] * threads > row["cores"] or row["config"].data_parallel.mode == "ps":
            continue
        profile = measure_on_ranks(row["config"], row["world_size"], threads, 257, repeats=10)
        chosen = dataclasses.replace(efficiency_of(row, shares), profile=profile)
        predicted = estimate(row["config"], row["world_size"], row["cluster"], chosen, vocab_size=257).time.total
        try:
            simulated = simulate_step(row["config"], row["world_size"], row["cluster"], chosen, vocab_size=257,
                                      record_spans=False).time
        except ConfigError:  # what the simulator refuses (parameter servers at --fidelity analytical)
            continue
        error, sim_error = predicted / row["measured"] - 1, simulated / row["measured"] - 1
        errors.append(abs(error))
        sim_errors.append(abs(sim_error))
        model_errors.append(abs(row["error"]))
        print(f"  {row['name']:<18}{row['world_size']:>6}{predicted:>13.4f}{simulated:>14.4f}{row['measured']:>13.4f}"
              f"{100 * row['error']:>10.1f}%{100 * error:>12.1f}%{100 * sim_error:>8.1f}%")
    print(f"# {len(errors)} layouts: median error {100 * statistics.median(errors):.1f}% with measured passes "
          f"({sum(e <= 0.1 for e in errors)} within 10%, worst {100 * max(errors):.1f}%; simulator "
          f"{100 * statistics.median(sim_errors):.1f}%, {sum(e <= 0.1 for e in sim_errors)} within 10%), "
          f"{100 * statistics.median(model_errors):.1f}% modelled ({sum(e <= 0.1 for e in model_errors)} within 10%)")


def _summary(rows: list[dict], errors: dict[str, float], measured: dict[str, float]) -> str:
    """The summary of `errors` (each layout's, against the steps `measured`): median, multi-rank median, within 10%,
    the worst row, and on the largest world size Kendall tau and the predicted best's gap."""
    top = max(r["world_size"] for r in rows)
    four = [r | {"measured": measured[r["name"]]} for r in rows if r["world_size"] == top]
    tau, chosen, gap = rank_order(four, [(1 + errors[r["name"]]) * r["measured"] for r in four])
    multi = [abs(errors[r["name"]]) for r in rows if r["world_size"] > 1]
    worst = max(errors, key=lambda k: abs(errors[k]))
    return (f"median {100 * statistics.median(abs(e) for e in errors.values()):.1f}%, "
            f"multi-rank {100 * statistics.median(multi) if multi else 0.0:.1f}%, "
            f"{sum(abs(e) <= 0.10 for e in errors.values())} within 10%, worst {100 * errors[worst]:+.1f}% ({worst}), "
            f"tau {tau:.3f}, predicted best ({chosen['name']}) {100 * gap:.1f}% over the measured best")


def _as_measured(rows: list[dict]) -> None:
    """Summarise the same predictions against each layout's step as measured, its batch's spell not divided out."""
    raw = {r["name"]: r["measured_raw"] for r in rows}
    print("# against the steps as measured (no control): "
          + _summary(rows, {r["name"]: r["predicted"] / raw[r["name"]] - 1 for r in rows}, raw))


def _other_rates(rows: list[dict], shares: dict[str, float], name: str, key: str = "cluster_other_rates") -> None:
    """Summarise the same measured steps predicted on each row's cluster `key` (same fitted constants): the run's
    other compute rates, or the compute rates of the rounds of the layout's own batch instead of the whole run's."""
    from fivefold.plan.estimate import estimate

    errors = {r["name"]: estimate(r["config"], r["world_size"], r[key], efficiency_of(r, shares),
                                  vocab_size=257).time.total / r["measured"] - 1 for r in rows}
    top = max(r["world_size"] for r in rows)
    print(f"# with the {name} instead: {_summary(rows, errors, {r['name']: r['measured'] for r in rows})}; "
          f"by {top}-rank layout: " + ", ".join(f"{r['name']} {100 * errors[r['name']]:+.1f}%"
                                                for r in rows if r["world_size"] == top))


def fit_compute(rows: list[dict]) -> tuple[dict[str, float], float, list[dict]]:
    """The planner's compute constants, fitted on the one-rank layouts only: the achieved share e of the
    matmul rate (--efficiency), one per compute dtype (`compute_dtype`: its peak is that dtype's matmul rate, and a
    CPU's bf16 matmul loop can run 5x its fp32 one where a small model's bf16 step does not), and the fixed host
    cost o of a block's forward pass (the cluster's accelerator.pass_overhead_us), fitted with the fp32 share on the
    dense fp32 anchors. The planner's one-rank step is linear in 1/e and o, t = M / e + O o + R (M, O and R read off
    three estimates), so the relative errors' least squares has a closed form. Then, at those, the routed experts'
    share (--expert-efficiency) on the one-rank MoE anchors, as a ratio r to the dtype's share (`shares["experts"]`;
    1.0 without a MoE anchor): their step is linear in e / (r e) = 1 / r as well. Multi-rank layouts then predict
    with no further fitting; a dtype with no one-rank anchor (a replayed run from before 2026-11-27 evening) takes
    the fp32 share."""
    from fivefold.plan.estimate import compute_dtype

    ones = [r for r in rows if r["world_size"] == 1]
    anchors = [r for r in ones if not r["config"].model.n_experts] or rows[:1]
    by_dtype: dict[str, list[dict]] = {}
    for row in anchors:
        by_dtype.setdefault(compute_dtype(row["config"]), []).append(row)
    first = "fp32" if "fp32" in by_dtype else next(iter(by_dtype))
    share, overhead = _fit_share_and_overhead([_linear_step(row) for row in by_dtype[first]])
    shares = {first: share}
    for dtype, group in by_dtype.items():  # the other dtypes' shares at that overhead
        if dtype != first:
            shares[dtype] = _fit_share([_linear_step(row) for row in group], overhead)
    shares.setdefault("fp32", share)
    shares.setdefault("bf16", shares["fp32"])
    shares["experts"] = 1.0
    moe = [r for r in ones if r["config"].model.n_experts]
    if moe:
        shares["experts"] = _fit_expert_ratio([_expert_step(row, shares, overhead) for row in moe])
    return shares, overhead, anchors + moe


def efficiency_of(row: dict, shares: dict[str, float]):
    """The fitted shares for the row's compute dtype (plan/efficiency.py Efficiency)."""
    from fivefold.plan.efficiency import Efficiency
    from fivefold.plan.estimate import compute_dtype

    share = shares[compute_dtype(row["config"])]
    ratio = shares.get("experts", 1.0)
    return Efficiency(share, experts=min(1.0, share * ratio) if ratio != 1.0 else 0.0)


def _expert_step(row: dict, shares: dict[str, float], overhead: float) -> tuple[float, float, float]:
    """(R, B, measured) of a one-rank MoE layout whose predicted step at expert ratio r is B + R (1 / r - 1)."""
    from fivefold.plan.efficiency import Efficiency
    from fivefold.plan.estimate import compute_dtype, estimate

    share = shares[compute_dtype(row["config"])]
    cluster = with_overhead(row["cluster"], overhead, row["cores"])

    def at(experts: float) -> float:
        return estimate(row["config"], 1, cluster, Efficiency(share, experts=experts), vocab_size=257).time.total

    base = at(share)
    return at(share / 2) - base, base, row["measured"]


def _fit_expert_ratio(system: list[tuple[float, float, float]]) -> float:
    """Least squares of the relative errors of t = B + R y over y = 1 / r - 1; the ratio r (`efficiency_of` caps
    the experts' share r e at 1); 1.0 when no anchor has routed work to price."""
    if not any(r for r, _, _ in system):
        return 1.0
    y = sum(r * (t - b) / t**2 for r, b, t in system) / sum((r / t) ** 2 for r, b, t in system)
    return 1 / max(1 + y, 1e-3)


def _linear_step(row: dict) -> tuple[float, float, float, float]:
    """(M, O, R, measured) of a one-rank layout whose predicted step is M / e + O o + R."""
    from fivefold.plan.estimate import estimate

    def at(e: float, o: float) -> float:
        cluster = with_overhead(row["cluster"], o, row["cores"])
        return estimate(row["config"], row["world_size"], cluster, e, vocab_size=257).time.total

    base = at(1.0, 0.0)
    matmuls, overhead = at(0.5, 0.0) - base, at(1.0, 1.0) - base  # seconds per unit of 1/e - 1, per us of o
    return matmuls, overhead, base - matmuls, row["measured"]


def _fit_share(system: list[tuple[float, float, float, float]], overhead: float) -> float:
    """Least squares of the relative errors of t = M x + O o + R over x = 1/e alone, o given; the share e."""
    x = sum(m * (t - r - v * overhead) / t**2 for m, v, r, t in system) / sum((m / t) ** 2 for m, v, r, t in system)
    return min(1.0, 1 / max(x, 1e-12))


def _fit_share_and_overhead(system: list[tuple[float, float, float, float]]) -> tuple[float, float]:
    """Least squares of the relative errors of t = M x + O o + R over x = 1/e and o >= 0."""
    if len(system) == 1:  # one layout: the share alone
        return _fit_share(system, 0.0), 0.0
    # minimise sum ((m x + v o + r - t) / t)^2 over x = 1/e and o
    sxx = sum((m / t) ** 2 for m, v, r, t in system)
    sxo = sum(m * v / t**2 for m, v, r, t in system)
    soo = sum((v / t) ** 2 for m, v, r, t in system)
    sxy = sum(m * (t - r) / t**2 for m, v, r, t in system)
    soy = sum(v * (t - r) / t**2 for m, v, r, t in system)
    det = sxx * soo - sxo**2
    x, o = (sxy * soo - soy * sxo) / det, (soy * sxx - sxy * sxo) / det
    if o < 0:  # no fixed cost to find: the share alone
        return _fit_share(system, 0.0), 0.0
    if x < 1:  # a share over the whole matmul rate: the share at 1, the fixed cost fitted again at that share
        return 1.0, max(0.0, sum(v * (t - r - m) / t**2 for m, v, r, t in system) / soo)
    return 1 / x, o


def with_overhead(cluster, overhead_us: float, cores: int):
    """The cluster with the fitted pass overhead, its ranks sharing this machine's `cores`."""
    return dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, pass_overhead_us=overhead_us,
                                                                        shared_cores=cores))


def world_medians(errors: dict[tuple[int, str], float]) -> dict[int, float]:
    """Each world size's signed median error over its layouts (errors: {(world size, layout): error}): how far its
    steps as a whole ran from the planner (plan_repeatability.py reads it over runs)."""
    return {w: statistics.median(e for (world, _), e in errors.items() if world == w)
            for w in sorted({w for w, _ in errors})}


def rank_order(rows: list[dict], predicted: list[float]) -> tuple[float, dict, float]:
    """(Kendall's tau between `predicted` and the rows' measured steps, the predicted best row, how much slower it
    measures than the measured best)."""
    measured = [r["measured"] for r in rows]
    chosen = rows[min(range(len(rows)), key=predicted.__getitem__)]
    return kendall_tau(predicted, measured), chosen, chosen["measured"] / min(measured) - 1


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a: (concordant - discordant) pairs over all pairs."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))]
    if not pairs:
        return 1.0
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum((a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return score / len(pairs)


def plot_scatter(rows: list[dict], output: str) -> Path:
    from fivefold.plotting import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for world in sorted({r["world_size"] for r in rows}):
        mine = [r for r in rows if r["world_size"] == world]
        ax.scatter([r["measured"] for r in mine], [r["predicted"] for r in mine], label=f"{world} rank(s)")
    top = max(max(r["measured"], r["predicted"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], color="black", linewidth=1)
    ax.plot([0, top], [0, 1.1 * top], color="grey", linewidth=0.5, linestyle="--")
    ax.plot([0, top], [0, 0.9 * top], color="grey", linewidth=0.5, linestyle="--", label="+-10%")
    ax.set_xlabel("measured step (s)")
    ax.set_ylabel("predicted step (s)")
    ax.set_title("fivefold plan vs measured, this machine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, output)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps (rounds) per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="layouts whose trainers are alive (and rotated) together")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(sorted(QUICK))}")
    parser.add_argument("--only", default="", help="comma-separated layout names to run (default: all)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--plot", help="draw predicted vs measured (PNG)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--replay", help="predict again the measurements stored by an earlier run's --json")
    parser.add_argument("--profile", action="store_true",
                        help="also predict the layouts whose threads fit the cores with their forward passes measured "
                             "(fivefold bench compute's profile) instead of modelled")
    parser.add_argument("--collectives", default="beside", choices=("beside", "alone"),
                        help="price the backend's collectives at their times beside compute (default: as a step makes "
                             "them) or back to back")
    parser.add_argument("--rates", default="matmul", choices=("matmul", "passes"),
                        help="the compute rate of a rank while all compute: a square matmul loop's on every rank at "
                             "once (default, as `fivefold bench comm --cluster-file` measures it) or one rank's alone "
                             "carried to all by a transformer's passes (benchmarks/shared_rates.py, an experiment); "
                             "the other is predicted too and summarised")
    parser.add_argument("--no-control", action="store_true",
                        help="time no control layout: each layout's step as measured, its batch's spell included "
                             "(default: the world's first layout timed in every batch too, each batch's steps divided "
                             "by its slowness)")
    parser.add_argument("--fidelity", default="hybrid", choices=FIDELITIES,
                        help="how the simulator plays collectives (default hybrid, as `fivefold simulate`)")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: must be at least 1 (layouts alive together)")

    from fivefold.config import load_config
    from fivefold.plan.cluster import cluster_from_dict
    from fivefold.plan.estimate import estimate
    from ranks import machine, spawn

    out_root = Path(os.environ.get("TMPDIR", "/tmp")) / f"plan_vs_measured-{os.getpid()}"
    base = ["--train.seq_len", str(args.seq_len), "--train.micro_batch_size", str(args.micro_batch),
            "--model.n_layers", str(args.layers), "--train.steps", str(args.steps + args.warmup + 1),
            "--train.eval_every", "0", "--checkpoint.enabled", "false", "--logging.progress", "false",
            "--logging.tensorboard", "false", "--logging.plot", "false", "--logging.sample_tokens", "0",
            "--train.log_every", "1000"]
    only = {name for name in args.only.split(",") if name}
    unknown = only - {name for _, name, _ in LAYOUTS + SOLO}
    if unknown:
        parser.error(f"--only: unknown layout(s) {', '.join(sorted(unknown))}")
    layouts = [row for row in LAYOUTS + SOLO if (not args.quick or row[1] in QUICK) and (not only or row[1] in only)]
    solo = {name for _, name, _ in SOLO}
    if args.replay:  # the stored measurements of an earlier run (its --json), predicted again
        stored = {r["name"]: r for r in json.loads(Path(args.replay).read_text())}
        for name, row in stored.items():  # a step, factor or recorded speed that is not a positive number is nonsense
            bad = [key for key in ("measured", "measured_raw", "batch_factor", "alone_fp32_tflops", "alone_pass_s")
                   if key in row and not (isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0)]
            if bad or "measured" not in row:
                parser.error(f"--replay {args.replay}: row {name!r} has {', '.join(bad) or 'no measured'} "
                             f"{[row.get(k) for k in bad] if bad else ''} (must be finite and positive)")
        layouts = [row for row in layouts if row[1] in stored]
    measured_on = next((r["machine"] for r in stored.values() if "machine" in r), "not recorded") if args.replay \
        else machine()
    rows = []
    for world_size in sorted({w for w, _, _ in layouts}):
        configs = [(name, load_config(ROOT / "configs" / "tiny.toml",
                                      [*base, *extra, "--train.output_dir", str(out_root / name)]))
                   for w, name, extra in layouts if w == world_size]
        alone = {name: extra for w, name, extra in layouts if w == world_size and name in solo}
        if args.replay:
            for name, config in configs:
                chosen = stored[name].get("cluster_alone", stored[name]["cluster"]) if args.collectives == "alone" \
                    else stored[name]["cluster"]
                other = stored[name].get("cluster_other_rates")  # runs before 2026-11-27 kept the matmul rates only
                if other is not None and args.rates != stored[name].get("rates", "matmul"):
                    chosen, other = other, stored[name]["cluster"]
                rows.append({"world_size": world_size, "name": name, "config": config,
                             "cluster": cluster_from_dict(chosen), "measured": stored[name]["measured"],
                             **({"cluster_other_rates": cluster_from_dict(other)} if other is not None else {}),
                             **({"cluster_batch": cluster_from_dict(stored[name]["cluster_batch"])}  # since 2026-11-28
                                if "cluster_batch" in stored[name] and args.rates == stored[name].get("rates", "matmul")
                                and args.collectives == "beside" else {}),
                             "cores": stored[name].get("cores", os.cpu_count() or 1), "machine": measured_on,
                             **{key: stored[name][key] for key in ("measured_raw", "batch_factor")  # since 2026-11-29
                                if key in stored[name]},
                             **{key: stored[name][key] for key in ("fp32_tflops", "fp32_tflops_together",
                                                                     "alone_fp32_tflops", "alone_pass_s")
                                if key in stored[name]}})
            continue
        together = [(name, config) for name, config in configs if name not in alone] or \
            [("_fit", load_config(ROOT / "configs" / "tiny.toml", [*base, "--train.output_dir", str(out_root / "_fit")]))]
        measured = spawn(_measure, world_size, (together, args.steps, args.warmup, args.batch, not args.no_control),
                         args.timeout)
        for name, extra in alone.items():  # run alone, after the batches: no control, factor 1
            measured["times"][name] = measured["raw_times"][name] = _measure_solo(
                world_size, name, ["--config", str(ROOT / "configs" / "tiny.toml"), *base, *extra], out_root, args.steps,
                args.timeout)
            measured["batch_factor"][name] = 1.0
        cluster = _cluster(world_size, measured, args.collectives, args.rates)
        other = _cluster(world_size, measured, "alone", args.rates)
        before = _cluster(world_size, measured, args.collectives, "matmul" if args.rates == "passes" else "passes")
        for name, config in configs:  # also at the rates of its own batch's rounds (an experiment, summarised)
            own = measured | measured["batches"][measured["batch_of"][name]] if name in measured["batch_of"] else measured
            rows.append({"world_size": world_size, "name": name, "config": config, "cluster": cluster, "cluster_alone": other,
                         "cluster_other_rates": before,
                         "cluster_batch": _cluster(world_size, own, args.collectives, args.rates),
                         "measured": measured["times"][name], "measured_raw": measured["raw_times"][name],
                         "batch_factor": measured["batch_factor"][name], "cores": measured["cores"],
                         "machine": measured_on, "fp32_tflops": measured["rates"]["fp32"],
                         "native_batches": measured["native_batches"],
                         "fp32_tflops_together": measured["together_tflops"],
                         "alone_fp32_tflops": measured["alone_fp32_tflops"], "alone_pass_s": measured["alone_pass_s"]})
    shares, overhead, anchors = fit_compute(rows)
    for row in rows:  # the dispatch overhead is one thread's work: it slows once the ranks outnumber the cores
        for key in ("cluster", "cluster_other_rates", "cluster_batch"):
            if key in row:
                row[key] = with_overhead(row[key], overhead * max(1.0, row["world_size"] / row["cores"]), row["cores"])
    from fivefold.errors import ConfigError
    from fivefold.sim.step import simulate_step

    errors, sim_errors, multi = [], [], []
    print(f"# measured on: {measured_on}")
    moe = sum(bool(r["config"].model.n_experts) for r in anchors)
    print(f"# efficiency {shares['fp32']:.3f} (bf16 {shares['bf16']:.3f}), block pass overhead {overhead:.0f} us (fitted on "
          f"the {len(anchors) - moe} dense one-rank layouts), routed experts at {shares['experts']:.3f} of the matmul "
          f"share (fitted on the {moe} MoE one-rank layout{'' if moe == 1 else 's'}); seq {args.seq_len}, micro-batch {args.micro_batch}, "
          f"{args.layers} layers of tiny")
    print(f"# {'layout':<18}{'ranks':>6}{'predicted(s)':>14}{'simulated(s)':>14}{'measured(s)':>13}{'plan err':>10}"
          f"{'sim err':>9}")
    for row in rows:
        efficiency = efficiency_of(row, shares)
        predicted = estimate(row["config"], row["world_size"], row["cluster"], efficiency, vocab_size=257).time.total
        try:
            simulated = simulate_step(row["config"], row["world_size"], row["cluster"], efficiency, args.fidelity,
                                      vocab_size=257, record_spans=False).time
        except ConfigError:  # what the simulator refuses (parameter servers at --fidelity analytical)
            simulated = sim_error = None
        else:
            sim_error = simulated / row["measured"] - 1
            sim_errors.append(abs(sim_error))
        error = predicted / row["measured"] - 1
        row.update(predicted=predicted, error=error, simulated=simulated, sim_error=sim_error)
        errors.append(abs(error))
        if row["world_size"] > 1:
            multi.append(abs(error))
        sim_text = ("-", "-") if simulated is None else (f"{simulated:.4f}", f"{100 * sim_error:.1f}%")
        print(f"  {row['name']:<18}{row['world_size']:>6}{predicted:>14.4f}{sim_text[0]:>14}{row['measured']:>13.4f}"
              f"{100 * error:>9.1f}%{sim_text[1]:>9}")
    if args.profile:
        _profiled(rows, shares)
    four = [r for r in rows if r["world_size"] == max(w for w, _, _ in layouts)]
    tau, chosen, best_gap = rank_order(four, [r["predicted"] for r in four])
    print(f"# {len(four)} layouts on {four[0]['world_size']} ranks: Kendall tau {tau:.3f} between predicted and measured "
          f"order; the predicted best ({chosen['name']}) measures {100 * best_gap:.1f}% over the measured best")
    print("# each world size's median error, signed (how far its steps as a whole ran from its own measured rates): "
          + ", ".join(f"{w} rank{'s' if w > 1 else ''} {100 * m:+.1f}%"
                      for w, m in world_medians({(r["world_size"], r["name"]): r["error"] for r in rows}).items()))
    for world_size in sorted({r["world_size"] for r in rows if r["cluster"].accelerator.ring_step_operators}):
        operators = next(r for r in rows if r["world_size"] == world_size)["cluster"].accelerator.ring_step_operators
        print(f"# {world_size} ranks: ring attention's own Python {operators:.1f} operators' worth per ring step and block "
              "pass (plan/ring_host.py, measured)")
    for world_size in sorted({r["world_size"] for r in rows if r["cluster"].accelerator.expert_group_us}):
        group = next(r for r in rows if r["world_size"] == world_size)["cluster"].accelerator.expert_group_us
        print(f"# {world_size} ranks: the grouped GEMM's fixed cost {group:.1f} us per expert and call "
              "(plan/expert_host.py, measured)")
    for world_size in sorted({r["world_size"] for r in rows if "fp32_tflops_together" in r}):
        row = next(r for r in rows if r["world_size"] == world_size and "fp32_tflops_together" in r)
        print(f"# {world_size} ranks, fp32 matmul per rank while all compute: the slowest rank's {row['fp32_tflops']:.4f} "
              f"TFLOP/s (priced), equal work between barriers {row['fp32_tflops_together']:.4f} "
              f"({100 * (row['fp32_tflops_together'] / row['fp32_tflops'] - 1):+.1f}%; recorded, not priced)")
    lone = {r["world_size"]: r for r in rows if "alone_pass_s" in r}
    if lone:  # since 2026-11-29 afternoon (before, the pass ran on the meta device and was not stored)
        print("# rank 0 alone on every core in each world size's rounds, the host's speed while that world size was timed "
              "(recorded, not priced): " + ", ".join(
                  f"{w} rank{'s' if w > 1 else ''}: reference pass {1e3 * r['alone_pass_s']:.1f} ms, fp32 matmul "
                  f"{r['alone_fp32_tflops']:.4f} TFLOP/s" for w, r in sorted(lone.items())))
    for world_size in sorted({r["world_size"] for r in rows}):
        factors = sorted({r["batch_factor"] for r in rows if r["world_size"] == world_size and "batch_factor" in r})
        if len(factors) > 1:
            first = next(r["name"] for r in rows if r["world_size"] == world_size)
            print(f"# {world_size} ranks: each batch's control step ({first}) over its median: "
                  + ", ".join(f"{f:.3f}" for f in factors) + " (each layout's step divided by its batch's)")
    if all("measured_raw" in r for r in rows) and any(r["batch_factor"] != 1.0 for r in rows):
        _as_measured(rows)
    if all("cluster_other_rates" in r for r in rows):
        _other_rates(rows, shares, f"{'passes' if args.rates == 'matmul' else 'matmul'} rates")
    if all("cluster_batch" in r for r in rows):
        _other_rates(rows, shares, "rates of each layout's own batch (not the whole run's)", "cluster_batch")
    if args.plot:
        print(f"wrote {plot_scatter(rows, args.plot)}")
    if args.json:
        keys = ("cluster", "cluster_alone", "cluster_other_rates", "cluster_batch")
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k not in ("config", *keys)} |
                                               {key: r[key].to_dict() for key in keys if key in r} |
                                               {"rates": args.rates} for r in rows], indent=2))
    median = statistics.median(errors) if errors else 0.0
    print(f"RESULT name=plan_vs_measured layouts={len(rows)} efficiency={shares['fp32']:.4f} "
          f"efficiency_bf16={shares['bf16']:.4f} expert_ratio={shares['experts']:.4f} overhead_us={overhead:.1f} "
          f"median_abs_error={median:.4f} multi_rank_median_abs_error={statistics.median(multi) if multi else 0.0:.4f} "
          f"within_10pct={sum(e <= 0.10 for e in errors)} worst_abs_error={max(errors, default=0.0):.4f} kendall_tau={tau:.4f} "
          f"best_gap={best_gap:.4f} sim_median_abs_error={statistics.median(sim_errors) if sim_errors else 0.0:.4f} "
          f"sim_worst_abs_error={max(sim_errors, default=0.0):.4f} "
          f"sim_within_10pct={sum(e <= 0.10 for e in sim_errors)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
