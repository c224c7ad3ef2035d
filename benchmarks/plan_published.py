"""The planner's predicted teraFLOP/s per GPU against Megatron-LM's published weak-scaling table (SC21).

Each row of Narayanan et al.'s Table 1 (GPT 1.7B to 1T on 32 to 3,072 A100-80GB GPUs,
plan/published.py) becomes a fivefold job with the row's tensor and pipeline degrees, micro-batch
and interleaving as the authors' script ran it, bf16 and full recomputation; the planner predicts
its step on the `a100-80gb` cluster preset, and the predicted rate is the paper's FLOP count per
iteration over (step x GPUs), the way the paper measures it. The planner's achieved share of peak
(--efficiency) is fitted on one row (the first, unless --fit names another) and used for all the
others, so the table checks what the planner adds as models grow: tensor-parallel all-reduces, the
pipeline bubble and its point-to-point transfers, the data-parallel all-reduce, the memory-bound
work; with --half-width, every GEMM is priced by the width law at that half width (both numbers
fitted on two rows: benchmarks/sim_published.py).

    python benchmarks/plan_published.py                      # the single-share table of docs/planner.md
    python benchmarks/plan_published.py --half-width 320.6   # the width law at the simulator's fit
    python benchmarks/plan_published.py --rows 3             # the first three rows (the test's run)

Prints one row per published run and
RESULT name=plan_published rows=N efficiency=... median_abs_error=... worst_abs_error=...
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from fivefold.plan.cluster import load_cluster
from fivefold.plan.efficiency import Efficiency
from fivefold.plan.estimate import PipelineRuns, estimate
from fivefold.plan.flops import count_parameters
from fivefold.plan.published import SC21_SOURCE, SC21_TABLE1, PublishedRun, paper_flops, sc21_config


def predicted_tflops(run: PublishedRun, efficiency: Efficiency, schedule: str | None,
                     runs: PipelineRuns) -> tuple[float, object]:
    found = estimate(sc21_config(run, schedule=schedule), run.gpus, load_cluster("a100-80gb"), efficiency, runs=runs)
    return paper_flops(run) / (found.time.total * run.gpus) / 1e12, found


def fit_efficiency(run: PublishedRun, schedule: str | None, runs: PipelineRuns, half_width: float) -> Efficiency:
    """The efficiency at which the planner predicts the row's published rate (bisection: rate rises with it)."""
    low, high = 0.01, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if predicted_tflops(run, Efficiency(mid, 0.0, None, half_width), schedule, runs)[0] < run.tflops_per_gpu:
            low = mid
        else:
            high = mid
    return Efficiency((low + high) / 2, 0.0, None, half_width)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=len(SC21_TABLE1), help="the first N rows of the table")
    parser.add_argument("--fit", default=SC21_TABLE1[0].name, help="the row the efficiency is fitted on")
    parser.add_argument("--schedule", default=None, choices=("1f1b", "gpipe", "zb-h1"),
                        help="pipeline schedule for the pipelined rows, without virtual stages (default: each "
                             "row's as the authors ran it, 1f1b or interleaved)")
    parser.add_argument("--half-width", type=float, default=0.0,
                        help="price every GEMM by the width law with this half width (plan/efficiency.py; "
                             "default 0: one share for every matmul)")
    args = parser.parse_args()
    rows = SC21_TABLE1[:args.rows]
    by_name = {run.name: run for run in SC21_TABLE1}
    if args.fit not in by_name:
        parser.error(f"--fit {args.fit!r}: not a row; rows are {', '.join(by_name)}")
    runs = PipelineRuns()
    efficiency = fit_efficiency(by_name[args.fit], args.schedule, runs, args.half_width)
    print(f"source: {SC21_SOURCE}")
    print(f"cluster a100-80gb, bf16, full recomputation, {args.schedule or 'schedules as run'}; "
          f"efficiency {efficiency.describe()} fitted on {args.fit}")
    print("| model | params (ours / published, B) | tp x pp x dp (virtual) | batch (micro) | step (s) | predicted TFLOP/s | "
          "published | error | bubble + pp comm | tp comm | dp comm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    started = time.perf_counter()
    for run in rows:
        rate, found = predicted_tflops(run, efficiency, args.schedule, runs)
        step = found.time
        params = count_parameters(sc21_config(run).model).total / 1e9
        error = rate / run.tflops_per_gpu - 1
        if run.name != args.fit:
            errors.append(abs(error))
        print(f"| {run.name} | {params:.2f} / {run.params_billion} | {run.tp} x {run.pp} x {run.dp} ({run.virtual}) | "
              f"{run.batch} ({run.micro_batch}) | "
              f"{step.total:.2f} | {rate:.1f} | {run.tflops_per_gpu:.0f} | {error:+.1%} | "
              f"{(step.bubble + step.pp_comm) / step.total:.1%} | {step.tp / step.total:.1%} | "
              f"{step.dp / step.total:.1%} |")
    print(f"planned in {time.perf_counter() - started:.1f} s")
    median = statistics.median(errors) if errors else 0.0
    worst = max(errors) if errors else 0.0
    print(f"RESULT name=plan_published rows={len(rows)} efficiency={efficiency.matmul:.4f} "
          f"median_abs_error={median:.4f} worst_abs_error={worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
