"""An experiment of plan_vs_measured.py (`--rates passes`): a CPU rank's compute rate while every rank computes,
carried from one rank alone by how a transformer's own passes slow down.

On a CPU host the ranks share the cores, so the planner's cluster describes each rank's rate as it is while all
compute (plan/cluster.py `Accelerator.tflops`); `fivefold bench comm --cluster-file` and plan_vs_measured time it
as a square matmul loop on every rank at once. On the AVX2 EPYC of 2026-11-27 that loop ran 2.4x slower on 2
one-thread ranks than on 1 rank of 2 threads, 5.6x on 4, where the trainer's dense step slowed by 2.1x and 3.8x,
and every 4-rank dense layout was predicted 20-50% slow. The alternative measured here:

    rate(all ranks) = matmul rate of rank 0 alone on every core x pass(alone) / pass(all ranks)

pass(alone): a reference model's forward and backward on rank 0 with every core's thread while the others wait;
pass(all ranks): the same on every rank at once with its own threads, the mean over ranks (a rank done first
lends its core to the rest). The reference is the `tiny` preset's block (dim 256, 8 heads) with its embedding and
head over 257 tokens, 4 sequences of 128 tokens, fp32; bf16 is carried by the same ratio. The oversubscribed
efficiency comes from the same passes: all ranks computing against only as many as the cores hold.

What it found (docs/planner.md). On the EPYC of 2026-11-27 the passes slowed by 1.2-1.4x on 2 ranks and 2.1-2.5x
on 4, and every multi-rank layout was predicted 31-42% short; but until 2026-11-29 afternoon the reference model
was left on the meta device, so those passes timed the operators' dispatch alone. With the model on the CPU (the
AMX Xeon, 2026-11-29 14:14) the passes' rates still price every multi-rank layout short (median 17.7% against
the square loop's 8.7% on the same steps, four-rank layouts 0-25% short): the trainer's step on a shared CPU
loses more than its passes do, to what the model prices as hidden or as time on the wire (gloo's copies,
reductions and loopback transfers run on the same two cores). Not adopted.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist


def reference_model() -> tuple[torch.nn.Module, torch.Tensor]:
    """The reference model (one `tiny` block, its embedding and head, 257 tokens) and a batch of 4 x 128 tokens."""
    from fivefold.model import build_model, materialize
    from fivefold.model.presets import PRESETS

    config = dataclasses.replace(PRESETS["tiny"], n_layers=1, vocab_size=257)
    generator = torch.Generator().manual_seed(0)
    # on the CPU with its weights initialised: `build_model` alone leaves it on the meta device, where a pass
    # dispatches its operators and computes nothing (this experiment's passes until 2026-11-29 afternoon)
    return materialize(build_model(config), "cpu"), torch.randint(0, 257, (4, 128), generator=generator)


def pass_seconds(computing: int, repeats: int = 4) -> float:
    """The mean over the first `computing` ranks of each one's median forward and backward of the reference model,
    all of them at once; the other ranks wait (collective)."""
    model, tokens = reference_model()

    def one_pass() -> None:
        model(tokens).float().pow(2).mean().backward()

    one_pass()  # warm up
    dist.barrier()
    value = 0.0
    if dist.get_rank() < computing:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - start)
        value = statistics.median(times)
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / computing


def shared_rates(cores: int, threads: int, alone_rates: dict[str, float],
                 alone_pass: float, repeats: int = 4) -> tuple[dict[str, float], float]:
    """(TFLOP/s per dtype a rank achieves while every rank computes, the oversubscribed efficiency) from the
    matmul rates and the reference pass of rank 0 alone on every core (`alone_rates`, `alone_pass`: see
    `alone_measurements`), the pass timed now on every rank at once with `threads` threads each and, where the
    ranks' threads outnumber the `cores`, on only as many ranks as the cores hold."""
    from fivefold.comm.bench import oversubscribed_share, ranks_fitting

    p = dist.get_world_size()
    shared = pass_seconds(p, repeats)
    rates = {dtype: rate * alone_pass / shared for dtype, rate in alone_rates.items()}
    if p * threads <= cores:
        return rates, 1.0
    fitting = ranks_fitting(cores, threads)
    return rates, oversubscribed_share(p, 1 / shared, fitting, 1 / pass_seconds(fitting, repeats))


def alone_measurements(device: torch.device, cores: int, dtypes: tuple[str, ...] = ("fp32", "bf16"),
                       seconds: float = 0.2, repeats: int = 4) -> tuple[dict[str, float], float]:
    """(matmul TFLOP/s per dtype, reference pass seconds) of rank 0 alone with `cores` threads while the other
    ranks wait (collective; every rank returns rank 0's figures)."""
    from fivefold.comm.bench import matmul_tflops

    before = torch.get_num_threads()
    if dist.get_rank() == 0:
        torch.set_num_threads(cores)
    try:
        rates = {dtype: matmul_tflops(dtype, device, seconds=seconds, computing=1) for dtype in dtypes}
        alone = pass_seconds(1, repeats)
    finally:
        torch.set_num_threads(before)
    return rates, alone
