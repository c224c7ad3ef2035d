"""The step simulator's (and the planner's) predictions against published Megatron-LM runs on A100s.

Two tables, both on the `a100-80gb` cluster preset (plan/published.py builds each row as a fivefold
job: the paper's width, depth, heads, vocabulary, sequence, degrees and batch):

- Narayanan et al., SC21, Table 1: achieved teraFLOP/s per GPU of GPT 1.7B to 1T on 32 to 3,072
  GPUs (full recomputation; micro-batch and interleaving as the authors' script ran each row); the
  predicted rate is the paper's FLOPs per iteration over (simulated step x GPUs), as the paper counts it.
- Korthikanti et al., 2022, Table 5: seconds per iteration of 22B, 175B, 530B and 1T with full
  recomputation and with sequence parallelism + selective recomputation.

The compute model has two fitted numbers (plan/efficiency.py, the width law): the achieved share of
peak in a wide GEMM, and the narrower side of a weight slice (min(K, N) on one rank) at which a
matmul reaches half of it, so that tensor parallelism's narrower slices and the attention core
(the head dimension) run further from peak. Both are fitted, with the simulator, on two SC21 rows (--fit;
default 1.7B, head dimension 96 and its attention core 15% of its matmul FLOPs, and 18B, tp 8) and
used for every other row, which are predictions. --no-width-law fits two fixed shares instead (the
matmuls' and the attention core's). Each step is simulated on the analytical path (one rank per
pipeline stage, collectives by formula on a contention-free fabric; --fidelity to change it).

    python benchmarks/sim_published.py                                   # the tables of docs/simulator.md
    python benchmarks/sim_published.py --sc21-rows 2 --korthikanti-rows 1  # the test's run

Prints both tables and
RESULT name=sim_published rows=N within_10pct=K median_abs_error=... worst_abs_error=... efficiency=...
       attention_efficiency=... half_width=... plan_median_abs_error=...
(errors over the rows not fitted: rate error for SC21, iteration-time error for Korthikanti et al.)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

from fivefold.plan.cluster import load_cluster
from fivefold.plan.efficiency import Efficiency
from fivefold.plan.estimate import PipelineRuns, estimate
from fivefold.plan.published import (KORTHIKANTI_MODES, KORTHIKANTI_SOURCE, KORTHIKANTI_TABLE, SC21_SOURCE,
                                     SC21_TABLE1, PublishedRun, korthikanti_config, paper_flops, sc21_config)
from fivefold.sim.names import FIDELITIES
from fivefold.sim.step import simulate_step

CLUSTER = load_cluster("a100-80gb")


def simulated_step(config, gpus: int, efficiency: Efficiency, fidelity: str):
    return simulate_step(config, gpus, CLUSTER, efficiency, fidelity)


def sc21_rate(run: PublishedRun, seconds: float) -> float:
    return paper_flops(run) / (seconds * run.gpus) / 1e12


def secant(residual: Callable[[float], float], start: float, low: float, high: float, tolerance: float) -> float:
    """The root of `residual` by the secant method from `start`, each step kept within [low, high], until the
    residual is under `tolerance`."""
    x0, x1 = start, start * 1.1
    f0, f1 = residual(x0), residual(x1)
    for _ in range(20):
        if f1 == f0:
            break
        x0, x1, f0 = x1, min(max(x1 - f1 * (x1 - x0) / (f1 - f0), low), high), f1
        f1 = residual(x1)
        if abs(f1) < tolerance:
            break
    return x1


def solve(rate_of: Callable[[float], float], target: float, start: float) -> float:
    """The share x in (0, 1] with rate_of(x) = target. The step is nearly affine in 1/x, so the secant
    method on 1/x converges in a few evaluations (each a simulation)."""
    return 1 / secant(lambda y: 1 / rate_of(1 / y) - 1 / target, 1 / start, 1.0, math.inf, 1e-6 / target)


def fit(attention_row: PublishedRun, matmul_row: PublishedRun, fidelity: str, width_law: bool = True) -> Efficiency:
    """The compute model's two numbers, alternately: the wide-GEMM share on the wide row, and on the narrow row
    either the width law's half width (attention share by the law) or, without it, the attention core's share."""
    def rate(run: PublishedRun, efficiency: Efficiency) -> float:
        return sc21_rate(run, simulated_step(sc21_config(run), run.gpus, efficiency, fidelity).time)

    def efficiency(matmul: float, other: float) -> Efficiency:
        return Efficiency(matmul, 0.0, None, other) if width_law else Efficiency(matmul, other)

    matmul, other = 0.5, (300.0 if width_law else 0.5)
    # the two numbers pull on each other's row (the wide row's attention core runs at the law's share, the narrow
    # row's GEMMs at the wide share): each round closes only part of the gap (10 rounds left the 18B row 0.03% off)
    for _ in range(60):
        previous = (matmul, other)
        matmul = solve(lambda x: rate(matmul_row, efficiency(x, other)), matmul_row.tflops_per_gpu, matmul)
        if width_law:
            other = half_width(lambda w: rate(attention_row, efficiency(matmul, w)), attention_row.tflops_per_gpu, other)
        else:
            other = solve(lambda x: rate(attention_row, efficiency(matmul, x)), attention_row.tflops_per_gpu, other)
        if max(abs(a - b) / b for a, b in zip(previous, (matmul, other))) < 1e-7:
            break
    return efficiency(matmul, other)


def half_width(rate_of: Callable[[float], float], target: float, start: float) -> float:
    """The half width w with rate_of(w) = target (the rate falls as w grows). A GEMM of narrowest width n runs
    at matmul * n / (n + w): its time, and so the step's, is affine in w, and the secant method on 1 / rate
    lands in two or three simulations."""
    return secant(lambda w: 1 / rate_of(w) - 1 / target, start, 1.0, 1e5, 1e-6 / target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sc21-rows", type=int, default=len(SC21_TABLE1), help="the first N rows of SC21 Table 1")
    parser.add_argument("--korthikanti-rows", type=int, default=len(KORTHIKANTI_TABLE),
                        help="the first N models of Korthikanti et al.")
    parser.add_argument("--fit", default="1.7B,18B",
                        help="the two SC21 rows the attention and the matmul shares are fitted on")
    parser.add_argument("--fidelity", default="analytical", choices=FIDELITIES)
    parser.add_argument("--no-width-law", action="store_true",
                        help="fit two fixed shares (matmuls, attention core) instead of the width law")
    args = parser.parse_args()
    by_name = {run.name: run for run in SC21_TABLE1}
    names = args.fit.split(",")
    if len(names) != 2 or any(name not in by_name for name in names):
        parser.error(f"--fit {args.fit!r}: two SC21 rows, comma-separated, of {', '.join(by_name)}")
    if not (0 <= args.sc21_rows <= len(SC21_TABLE1) and 0 <= args.korthikanti_rows <= len(KORTHIKANTI_TABLE)):
        parser.error("--sc21-rows and --korthikanti-rows: between 0 and the table's length")
    started = time.perf_counter()
    efficiency = fit(by_name[names[0]], by_name[names[1]], args.fidelity, not args.no_width_law)
    what = (f"width law: {efficiency.matmul:.4f} of peak in wide GEMMs, half of it at width {efficiency.half_width:.0f} "
            f"(attention core at head dim 128: {efficiency.share(128):.4f})" if efficiency.half_width else
            f"efficiency {efficiency.matmul:.4f} (matmuls), {efficiency.attention:.4f} (attention core)")
    print(f"cluster a100-80gb, fidelity {args.fidelity}; {what}, fitted on {names[0]} and {names[1]} "
          f"in {time.perf_counter() - started:.1f} s")
    runs = PipelineRuns()
    errors, plan_errors = [], []

    print(f"\nsource: {SC21_SOURCE}")
    print("| model | tp x pp x dp (virtual) | batch (micro) | simulated step (s) | simulated TFLOP/s | published | error | "
          "planner TFLOP/s | planner error | pipeline | tp | dp |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in SC21_TABLE1[:args.sc21_rows]:
        config = sc21_config(run)
        step = simulated_step(config, run.gpus, efficiency, args.fidelity)
        phases = step.breakdown()
        rate = sc21_rate(run, step.time)
        planned = sc21_rate(run, estimate(config, run.gpus, CLUSTER, efficiency, runs=runs).time.total)
        error, plan_error = rate / run.tflops_per_gpu - 1, planned / run.tflops_per_gpu - 1
        fitted = run.name in names
        if not fitted:
            errors.append(abs(error))
            plan_errors.append(abs(plan_error))
        print(f"| {run.name}{' (fitted)' if fitted else ''} | {run.tp} x {run.pp} x {run.dp} ({run.virtual}) | "
              f"{run.batch} ({run.micro_batch}) | "
              f"{step.time:.2f} | {rate:.1f} | {run.tflops_per_gpu:.0f} | {error:+.1%} | {planned:.1f} | "
              f"{plan_error:+.1%} | {phases['pipeline'] / step.time:.1%} | {phases['tp'] / step.time:.1%} | "
              f"{phases['dp'] / step.time:.1%} |", flush=True)

    print(f"\nsource: {KORTHIKANTI_SOURCE}")
    print("| model | recomputation | tp x pp x dp (virtual) | batch (micro) | simulated (s) | published (s) | error | "
          "planner (s) | planner error | pipeline | tp |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in KORTHIKANTI_TABLE[:args.korthikanti_rows]:
        for mode in KORTHIKANTI_MODES:
            config = korthikanti_config(run, mode)
            step = simulated_step(config, run.gpus, efficiency, args.fidelity)
            phases = step.breakdown()
            planned = estimate(config, run.gpus, CLUSTER, efficiency, runs=runs).time.total
            published = run.seconds[mode]
            error, plan_error = step.time / published - 1, planned / published - 1
            errors.append(abs(error))
            plan_errors.append(abs(plan_error))
            what = "full" if mode == "full" else "sp + selective"
            print(f"| {run.name} | {what} | {run.tp} x {run.pp} x {run.dp} ({run.virtual}) | {run.batch} "
                  f"({run.micro_batch}) | {step.time:.2f} | {published:.2f} | {error:+.1%} | {planned:.2f} | "
                  f"{plan_error:+.1%} | {phases['pipeline'] / step.time:.1%} | {phases['tp'] / step.time:.1%} |",
                  flush=True)
    print(f"\nsimulated in {time.perf_counter() - started:.1f} s")
    within = sum(error <= 0.10 for error in errors)
    print(f"RESULT name=sim_published rows={len(errors)} within_10pct={within} "
          f"median_abs_error={statistics.median(errors) if errors else 0.0:.4f} "
          f"worst_abs_error={max(errors, default=0.0):.4f} efficiency={efficiency.matmul:.4f} "
          f"attention_efficiency={efficiency.attention:.4f} half_width={efficiency.half_width:.1f} "
          f"plan_median_abs_error={statistics.median(plan_errors) if plan_errors else 0.0:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
