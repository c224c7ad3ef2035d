"""The planner's and the simulator's step time and memory against one accelerator's measured training step.

benchmarks/plan_vs_measured.py checks the planner layout by layout on this project's CPU host. This script
checks the accelerator presets (docs/planner.md: an H100's or H200's datasheet peak, memory bandwidth and
HBM) on the accelerator itself, for a matrix of one-GPU jobs (the 1B and 3B Llama 3.2 shapes: recomputation
off, full and selective, gradient accumulation, a longer sequence, train.compile, the chunked head, a small
model eager and compiled, and a MoE model (Qwen3-30B-A3B's layer on 4 layers) with either expert kernel and
under full recomputation). Each job,
in a process of its own so that no job's memory shows in another's peak:

  measured   the real Trainer.train_step (data, forward, backward, clip, AdamW), the median of --steps after
             --warmup, on the host clock after a device synchronize; the peak of max_memory_allocated over
             the timed steps
  modelled   `fivefold plan` on the preset at the planner's default efficiency (0.5 of peak in every matmul)
  fitted     the efficiency at which the modelled step equals the measured one (a step is affine in
             1 / efficiency: two estimates solve it)
  one-fit    every job predicted at the efficiency fitted on the first job alone: what a user who measured
             one job would be told about the others
  profiled   `fivefold bench compute` (plan/profile_measure.py) measures the job's block, attention core and
             head on the device, then `fivefold plan --profile` prices the step by them
  simulated  `fivefold simulate --profile` (sim/step.py): the same job played out by the simulator
  memory     the planner's bytes per rank against the measured peak
  kernels    (--kernels, CUDA) the memory-bound kernels' share of the preset's memory bandwidth over two
             profiled steps: fused AdamW, the gradient norm, clipping's scaling, the MoE experts' bf16 stack
             (what the presets' accelerator.memory_efficiency, 0.74, was measured from)

    python benchmarks/plan_vs_gpu.py                         # the table of docs/planner.md (CUDA)
    python benchmarks/plan_vs_gpu.py --jobs 1b,3b --json out.json
    python benchmarks/plan_vs_gpu.py --jobs 1b,moe --kernels      # the streaming shares of docs/planner.md runs 8-9
    python benchmarks/plan_vs_gpu.py --device cpu --cluster cluster.toml --jobs tiny,tiny-full  # the test's run

Prints one row per job and
RESULT name=plan_vs_gpu jobs=N failed=N device=... modelled_median_abs_error=... one_fit_median_abs_error=...
       one_fit_worst_abs_error=... profiled_median_abs_error=... simulated_median_abs_error=...
       memory_median_abs_error=... [streaming_share_median=... with --kernels]
The peer is the measurement itself: every figure is a prediction against the runtime's own step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name: (model preset, seq_len, micro-batch, train.* overrides[, other sections' overrides])
# The MoE jobs are Qwen3-30B-A3B's layer (128 experts of 768, top-8, width 2,048) on 4 layers, which one GPU holds.
MOE_SHAPE = {"model": {"n_layers": 4}}
JOBS = {
    "1b": ("llama3.2-1b", 2048, 4, {}),
    "1b-full": ("llama3.2-1b", 2048, 4, {"recompute": "full"}),
    "1b-selective": ("llama3.2-1b", 2048, 4, {"recompute": "selective"}),
    "1b-accum2": ("llama3.2-1b", 2048, 4, {"grad_accum_steps": 2}),
    "1b-seq4096": ("llama3.2-1b", 4096, 2, {}),
    "1b-compile": ("llama3.2-1b", 2048, 4, {"compile": True}),
    "1b-chunked": ("llama3.2-1b", 2048, 4, {"compile": True, "loss_chunk_tokens": 4096}),
    "3b": ("llama3.2-3b", 2048, 2, {}),
    "small": ("small", 2048, 8, {}),
    "small-compile": ("small", 2048, 8, {"compile": True}),
    "moe": ("qwen3-30b-a3b", 2048, 2, {}, {**MOE_SHAPE, "expert_parallel": {"kernel": "grouped"}}),
    "moe-loop": ("qwen3-30b-a3b", 2048, 2, {}, {**MOE_SHAPE, "expert_parallel": {"kernel": "loop"}}),
    "moe-full": ("qwen3-30b-a3b", 2048, 2, {"recompute": "full"}, {**MOE_SHAPE, "expert_parallel": {"kernel": "grouped"}}),
    # the CPU smoke test's jobs (tests/test_benchmarks.py): the same code path on a model this host can train
    "tiny": ("tiny", 64, 2, {}),
    "tiny-full": ("tiny", 64, 2, {"recompute": "full"}),
    "tiny-moe": ("tiny-moe", 64, 2, {}, {"expert_parallel": {"kernel": "loop"}}),
}
DEFAULT_JOBS = ("1b,1b-full,1b-selective,1b-accum2,1b-seq4096,1b-compile,1b-chunked,3b,small,small-compile,"
                "moe,moe-loop,moe-full")
# The memory-bound kernels of a step whose bytes are known (docs/planner.md "Run 6"): the optimizer's fused AdamW
# (28 bytes a parameter), the gradients' foreach norm (4) and clipping's foreach scaling (8), and the grouped MoE
# kernel's bf16 stack of its experts' fp32 weights (6 bytes an expert weight): op -> (label, bytes, what they count)
STREAMING_KERNELS = {"aten::_fused_adamw_": ("fused AdamW", 28, "parameters"),
                     "aten::_foreach_norm": ("gradient norm", 4, "parameters"),
                     "aten::_foreach_mul_": ("clipping's scaling", 8, "parameters"),
                     "aten::_foreach_copy_": ("experts' bf16 stack", 6, "expert_weights")}
# a device name's preset (docs/planner.md's table)
DEVICE_PRESETS = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("B200", "b200"))


def job_config(name: str, device: str, warmup: int, steps: int):
    from fivefold.config import JobConfig
    from fivefold.model import get_preset

    preset, seq_len, micro, overrides, *sections = JOBS[name]
    config = JobConfig()
    config.model = dataclasses.replace(get_preset(preset), max_seq_len=max(seq_len, get_preset(preset).max_seq_len))
    for section, values in (sections[0] if sections else {}).items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    config.data = dataclasses.replace(config.data, source="stdlib", tokenizer="byte")
    dtype = "bf16" if device.startswith("cuda") else "fp32"
    config.train = dataclasses.replace(config.train, seq_len=seq_len, micro_batch_size=micro, dtype=dtype,
                                       device=device, steps=warmup + steps, eval_every=0, log_every=10**6,
                                       output_dir="/tmp/fivefold-plan-vs-gpu", **overrides)
    config.checkpoint = dataclasses.replace(config.checkpoint, enabled=False, overwrite=True)
    config.logging = dataclasses.replace(config.logging, progress=False, tensorboard=False, plot=False,
                                         sample_prompt="")
    config.validate()
    return config


def streaming_shares(device_seconds: dict[str, float], counts: dict[str, int], bandwidth_gbs: float) -> dict[str, float]:
    """Each memory-bound kernel of `STREAMING_KERNELS` found: its bytes per step (bytes per unit x `counts` of that
    unit) over its GPU seconds per step, as a share of `bandwidth_gbs` (the preset's memory_bandwidth_gbs): the
    measurement `Accelerator.memory_efficiency` stands for."""
    return {label: per * counts[unit] / seconds / (bandwidth_gbs * 1e9)
            for name, (label, per, unit) in STREAMING_KERNELS.items()
            if (seconds := device_seconds.get(name, 0.0)) > 0 and counts.get(unit)}


def kernel_seconds(trainer, steps: int = 2) -> dict[str, float]:
    """GPU seconds per step of each op of `STREAMING_KERNELS` (its kernels' time, torch.profiler) over `steps`
    more steps of `trainer`. The op's self time on the device is its kernels': its total would also count the
    host's waits for a full launch queue under it ("Command Buffer Full": 35 and 77 ms a step under the 1B
    model's norm and scaling on an H200, whose kernels took 1.4 and 2.7)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
    return {event.key: event.self_device_time_total * 1e-6 / steps for event in prof.key_averages()
            if event.key in STREAMING_KERNELS}


def measure_step(config, warmup: int, steps: int, kernels: bool = False) -> dict:
    """The trainer's step: median seconds of `steps` after `warmup`, and the peak bytes of the timed steps;
    kernels (CUDA): then each memory-bound kernel's GPU seconds per step (`kernel_seconds`) and what it counts."""
    import torch

    from fivefold.train.trainer import Trainer

    cuda = config.train.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    trainer = Trainer(config)
    times, loss = [], float("nan")
    try:
        for index in range(warmup + steps):
            if index == warmup and cuda:  # the warm-up's compilation workspaces are not the step's memory
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            loss = trainer.train_step()["loss"]
            sync()
            if index >= warmup:
                times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        found = {}
        if kernels and cuda:
            named = list(trainer.model.named_parameters())
            found = {"kernel_seconds": kernel_seconds(trainer),
                     "kernel_counts": {"parameters": sum(p.numel() for _, p in named),
                                       "expert_weights": sum(p.numel() for n, p in named if ".feed_forward.experts." in n)}}
        return {"step_s": statistics.median(times), "peak_bytes": peak, "loss": loss,
                "vocab_size": trainer.model_config.vocab_size, "tokens": trainer.tokens_per_step, **found}
    finally:
        trainer.close()
        del trainer
        if cuda:
            torch.cuda.empty_cache()


def affine_efficiency(step_at, efficiency: float, measured: float) -> float | None:
    """The efficiency e at which step_at(e) = measured, given that a step is a + b / e (the matmuls' time scales
    with 1 / e, the optimizer and the rest do not); None when no e in (0, 1] reaches it."""
    high, low = step_at(efficiency), step_at(efficiency / 2)
    b = (low - high) * efficiency
    a = high - b / efficiency
    if b <= 0 or measured <= a:
        return None
    fitted = b / (measured - a)
    return fitted if fitted <= 1 else None


def measure_job(name: str, device: str, cluster_name: str, warmup: int, steps: int, repeats: int,
                kernels: bool = False) -> dict:
    """One job, in this process: its measured step and profile, and every prediction."""
    from fivefold.plan.cluster import load_cluster
    from fivefold.plan.efficiency import Efficiency
    from fivefold.plan.estimate import estimate
    from fivefold.plan.profile_measure import measure_profile
    from fivefold.sim.step import simulate_step

    config = job_config(name, device, warmup, steps)
    cluster = load_cluster(cluster_name)
    measured = measure_step(config, warmup, steps, kernels)
    if "kernel_seconds" in measured:
        measured["streaming_shares"] = streaming_shares(measured["kernel_seconds"], measured["kernel_counts"],
                                                        cluster.accelerator.memory_bandwidth_gbs)
    vocab = measured["vocab_size"]
    profile = measure_profile(config, vocab, repeats, device)

    def step_at(efficiency) -> float:
        return estimate(config, 1, cluster, efficiency, vocab).time.total

    default = Efficiency()
    modelled = estimate(config, 1, cluster, default, vocab)
    profiled = Efficiency(profile=profile)
    simulated = simulate_step(config, 1, cluster, profiled, vocab_size=vocab, record_spans=False)
    return {"job": name, **measured, "modelled_s": modelled.time.total, "modelled_compute_s": modelled.time.compute,
            "modelled_optimizer_s": modelled.time.optimizer,
            "fitted_efficiency": affine_efficiency(step_at, default.matmul, measured["step_s"]),
            "profiled_s": step_at(profiled), "simulated_s": simulated.time,
            "planned_bytes": modelled.memory.total, "flops_per_step": modelled.model_flops_per_step,
            "peak_flops": modelled.peak_flops,
            "backward_climb_bytes": modelled.memory.backward_climb,
            "profile": {"block_s": profile.block, "moe_block_s": profile.moe_block, "core_s": profile.core,
                        "head_s": profile.head, "expert_kernel": profile.expert_kernel, "device": profile.device}}


def one_fit(rows: list[dict], device: str, cluster_name: str, warmup: int, steps: int) -> float | None:
    """Predict every job at the efficiency fitted on the first: sets each row's one_fit_s."""
    from fivefold.plan.cluster import load_cluster
    from fivefold.plan.efficiency import Efficiency
    from fivefold.plan.estimate import estimate

    efficiency = rows[0]["fitted_efficiency"]
    if efficiency is None:
        return None
    cluster = load_cluster(cluster_name)
    for row in rows:
        config = job_config(row["job"], device, warmup, steps)
        row["one_fit_s"] = estimate(config, 1, cluster, Efficiency(efficiency), row["vocab_size"]).time.total
    return efficiency


def measure_alone(args: argparse.Namespace, name: str) -> dict:
    """One job in a process of its own (a job measured after another in one process reads the other's
    allocator state into its peak)."""
    command = [sys.executable, __file__, "--row", name, "--device", args.device, "--cluster", args.cluster,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--repeats", str(args.repeats),
               *(["--kernels"] if args.kernels else [])]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def error(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


def summarise(rows: list[dict]) -> dict:
    """Median and worst absolute error of each prediction over the jobs."""
    out = {}
    for key, measured in (("modelled", "step_s"), ("one_fit", "step_s"), ("profiled", "step_s"),
                          ("simulated", "step_s"), ("memory", "peak_bytes")):
        predicted = "planned_bytes" if key == "memory" else f"{key}_s"
        errors = [abs(e) for row in rows if (e := error(row.get(predicted), row.get(measured))) is not None]
        out[f"{key}_median_abs_error"] = statistics.median(errors) if errors else None
        out[f"{key}_worst_abs_error"] = max(errors) if errors else None
    return out


def print_table(rows: list[dict], device: str, cluster: str, fitted: float | None) -> None:
    def pct(value: float | None) -> str:
        return f"{value:+.0%}" if value is not None else "-"

    def ms(value: float | None) -> str:
        return f"{value * 1e3:.1f}" if value is not None else "-"

    print(f"one-accelerator jobs on {device} against the `{cluster}` preset; one-fit efficiency "
          f"{fitted if fitted is None else round(fitted, 4)} (fitted on {rows[0]['job']})")
    print(f"{'job':<13} {'measured ms':>11} {'MFU':>6} {'modelled':>15} {'fitted eff':>10} {'one-fit':>15} "
          f"{'profiled':>15} {'simulated':>15} {'peak GiB':>9} {'planned GiB':>12}")
    for row in rows:
        mfu = row["flops_per_step"] / (row["step_s"] * row["peak_flops"])

        def cell(key: str) -> str:
            return f"{ms(row.get(key))} ({pct(error(row.get(key), row['step_s']))})"

        gib = (f"{row['peak_bytes'] / 2**30:>9.2f} {row['planned_bytes'] / 2**30:>6.2f} "
               f"({pct(error(row['planned_bytes'], row['peak_bytes']))})" if row["peak_bytes"] else f"{'-':>9} "
               f"{row['planned_bytes'] / 2**30:>12.2f}")
        fit = f"{row['fitted_efficiency']:.3f}" if row["fitted_efficiency"] is not None else "-"
        print(f"{row['job']:<13} {ms(row['step_s']):>11} {mfu:>6.1%} {cell('modelled_s'):>15} {fit:>10} "
              f"{cell('one_fit_s'):>15} {cell('profiled_s'):>15} {cell('simulated_s'):>15} {gib}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=DEFAULT_JOBS, help=f"comma-separated, of {','.join(JOBS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cluster", default="", help="a preset or cluster file (default: the device's preset)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10, help="timed passes of each profiled part")
    parser.add_argument("--kernels", action="store_true",
                        help="(CUDA) also profile two steps and print the share of the preset's memory bandwidth its "
                             "memory-bound kernels reach (AdamW, the gradient norm, clipping, the MoE weight stack)")
    parser.add_argument("--json", help="also write the rows and the summary here")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one job, its row printed as JSON
    args = parser.parse_args(argv)
    wanted = args.jobs.split(",")
    if unknown := [name for name in [*wanted, *([args.row] if args.row else [])] if name not in JOBS]:
        parser.error(f"unknown job(s) {unknown}: choose from {','.join(JOBS)}")
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--warmup, --steps and --repeats must be at least 1")
    import torch

    if args.kernels and not args.device.startswith("cuda"):
        parser.error("--kernels times the GPU's kernels: it needs --device cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here (docs/planner.md has the last run on one); "
                     "--device cpu --cluster FILE runs the same code on this host")
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    if not args.cluster:
        args.cluster = next((preset for key, preset in DEVICE_PRESETS if key in device_name), "")
        if not args.cluster:
            parser.error(f"no preset for {device_name!r}: name one or a cluster file with --cluster")
    from fivefold.errors import ConfigError
    from fivefold.plan.cluster import load_cluster

    try:
        load_cluster(args.cluster)  # a bad name or file fails here, not in every job's process
    except ConfigError as exc:
        parser.error(str(exc))
    if args.row:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's lines; stdout is the row alone
            row = measure_job(args.row, args.device, args.cluster, args.warmup, args.steps, args.repeats, args.kernels)
        print(json.dumps(row))
        return 0
    rows, failed = [], []
    for name in wanted:
        try:
            rows.append(measure_alone(args, name))
        except subprocess.CalledProcessError as exc:  # one job's failure (out of memory, say) leaves the others
            failed.append(name)
            print(f"job {name} failed (exit {exc.returncode}); its error is above", file=sys.stderr, flush=True)
            continue
        print(f"{name}: measured {rows[-1]['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        if args.json:  # the rows so far, should a later job outlast the caller's patience
            Path(args.json).write_text(json.dumps({"device": device_name, "rows": rows}, indent=2), encoding="utf-8")
    if not rows:
        print(f"every job failed: {','.join(failed)}", file=sys.stderr)
        return 1
    fitted = one_fit(rows, args.device, args.cluster, args.warmup, args.steps)
    summary = summarise(rows)
    print_table(rows, device_name, args.cluster, fitted)
    shares = [share for row in rows for share in row.get("streaming_shares", {}).values()]
    if shares:
        bandwidth = load_cluster(args.cluster).accelerator.memory_bandwidth_gbs
        print(f"memory-bound kernels' share of the preset's {bandwidth:,.0f} GB/s (median {statistics.median(shares):.3f}; "
              f"the presets price such work at accelerator.memory_efficiency):")
        for row in rows:
            if row.get("streaming_shares"):
                print(f"  {row['job']:<13} " + ", ".join(f"{label} {share:.3f}" for label, share in
                                                         row["streaming_shares"].items()))
        summary["streaming_share_median"] = statistics.median(shares)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "torch": torch.__version__, "cluster":
                                               args.cluster, "one_fit_efficiency": fitted, "rows": rows,
                                               "summary": summary}, indent=2), encoding="utf-8")

    def fmt(value: float | None) -> str:
        return "nan" if value is None else f"{value:.4f}"

    if failed:
        print(f"failed: {','.join(failed)}")
    print(f"RESULT name=plan_vs_gpu jobs={len(rows)} failed={len(failed)} device={device_name.replace(' ', '_')} "
          + " ".join(f"{key}={fmt(value)}" for key, value in summary.items()
                     if key.endswith("median_abs_error") or key in ("one_fit_worst_abs_error", "streaming_share_median")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
