"""What a run reports, read from the gradient sync and the step function, never from the loop's branches.

    model-state table   bytes of parameters, gradients and optimizer states this rank holds
                        (measured once, right after the first optimizer step, when every state
                        exists) beside the ZeRO paper's formula for the sync in use
    throughput window   tokens/s and MFU over the steps since the last log line (nanoGPT/PaLM:
                        MFU = model FLOPs per token x tokens/s / (peak FLOP/s x ranks)); without
                        a known peak, the achieved model TFLOP/s per rank instead
    communication       wire_bytes (bytes this rank sent for the step's gradients) and
                        comm_hidden (share of a communication thread's busy time that backward hid)
    pipeline            the measured bubble (idle / compute over every stage's timed events) beside
                        the schedule's ideal, and a Chrome trace of the last step when asked
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.config import JobConfig
from fivefold.parallel.parallelize import Parallelized
from fivefold.parallel.pipeline.schedules import ideal_bubble
from fivefold.parallel.pipeline.trace import measure_bubble, write_chrome_trace
from fivefold.plan.memory import ModelStateBytes
from fivefold.train.memory import measure_model_states
from fivefold.train.metrics import peak_memory_gib, read_metrics


@dataclass
class TrainResult:
    """What `Trainer.fit` returns on every training rank."""

    steps: int
    final_loss: float
    val_loss: float | None
    unigram_baseline: float
    checkpoint: Path | None
    metrics_path: Path
    plot_path: Path | None
    sample: str | None
    losses: list[float]


def completed_result(output_dir: Path, step: int, checkpoint: Path | None) -> TrainResult:
    """The result of a run that was already complete, from its metrics (nothing is trained)."""
    records = read_metrics(output_dir / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r and "skipped" not in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return TrainResult(step, losses[-1] if losses else float("nan"), vals[-1] if vals else None, float("nan"),
                       checkpoint, output_dir / "metrics.jsonl", None, None, [])


class Reporter:
    """Per-step metrics and start-up descriptions for one rank's parallelized model."""

    def __init__(self, config: JobConfig, parallel: Parallelized, world_size: int, flops_per_token: float,
                 peak_tflops: float | None, device: torch.device, output_dir: Path):
        self.config, self.parallel, self.world_size = config, parallel, world_size
        self.flops_per_token, self.peak_tflops, self.device = flops_per_token, peak_tflops, device
        self.output_dir = output_dir
        self.model_state_bytes: ModelStateBytes | None = None
        self._notes: list[str] = []
        self._window_start, self._window_tokens = time.perf_counter(), 0

    # ------------------------------------------------------------------ model states
    def expected_model_states(self) -> ModelStateBytes:
        return self.parallel.sync.expected_model_states(self.parallel.parameters)

    def after_optimizer_step(self) -> str | None:
        """Measure model states once, after the first step (every state exists then); returns the table to print."""
        if self.model_state_bytes is not None:
            return None
        self.parallel.sync.flush()  # a deferred update (priority schedule) creates the optimizer states
        self.model_state_bytes = measure_model_states(self.parallel.sync)
        return self.describe_model_states()

    def describe_model_states(self) -> str:
        sync, measured, expected = self.parallel.sync, self.model_state_bytes, self.expected_model_states()
        rows = [("parameters", measured.parameters, expected.parameters),
                ("gradients", measured.gradients, expected.gradients),
                ("optimizer", measured.optimizer, expected.optimizer),
                ("total", measured.total, expected.total)]
        split = " (this rank's tensor-parallel / pipeline part)" if self.parallel.folds.tp > 1 or self.parallel.stage_split else ""
        head = (f"model states per rank, measured | formula ({sync.describe()}; "
                f"Ψ = {self.parallel.parameters:,}{split}):")
        return "\n".join([head] + [f"  {name:<10} {m:>14,} B | {e:>14,} B" for name, m, e in rows])

    def describe_peak(self, source: str) -> str:
        if self.peak_tflops is None:
            return f"MFU not reported ({source}; achieved TFLOP/s per rank instead)"
        return f"peak {self.peak_tflops:.3f} TFLOP/s per rank ({source})"

    def summary(self, final: float, val_loss: float | None, baseline: float, checkpoint: Path | None,
                metrics_path: Path, plot: Path | None, sample: str | None, skipped: int, rollbacks: int) -> str:
        """The lines printed at the end of a run."""
        lines = [f"final train loss {final:.4f}" + (f", validation loss {val_loss:.4f}" if val_loss is not None else "")
                 + f"; unigram baseline {baseline:.4f} nats/token"]
        if skipped or rollbacks:
            lines.append(f"non-finite guard: {skipped} step(s) skipped, {rollbacks} rollback(s)")
        lines.append(f"checkpoint: {checkpoint}\nmetrics:    {metrics_path}")
        if plot:
            lines.append(f"plot:       {plot}")
        if self.config.logging.tensorboard:
            lines.append(f"tensorboard: {self.output_dir / 'tensorboard'}")
        if sample is not None:
            lines.append("sample:\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
        return "\n".join(lines)

    def take_notes(self) -> list[str]:
        """Lines to print (rank 0) since the last call."""
        notes, self._notes = self._notes, []
        return notes

    # ------------------------------------------------------------------ per-step metrics
    def step_metrics(self, step: int, tokens: int, logged: bool) -> dict[str, float]:
        """Communication metrics every step; throughput, memory, overlap and pipeline figures on logged steps."""
        sync = self.parallel.sync
        values: dict[str, float] = {}
        if sync.reports_wire_bytes:
            values["wire_bytes"] = sync.wire_bytes
        self._window_tokens += tokens
        if not logged:
            return values
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        tokens_per_s = self._window_tokens / (time.perf_counter() - self._window_start)
        achieved = self.flops_per_token * tokens_per_s / self.world_size  # model FLOP/s per rank
        values["tokens_per_s"] = tokens_per_s
        if self.peak_tflops is not None:
            values["mfu"] = achieved / (self.peak_tflops * 1e12)
        else:
            values["tflops"] = achieved / 1e12
        values["peak_mem_gib"] = peak_memory_gib(self.device)
        if sync.overlap is not None and sync.overlap.hidden_fraction() is not None:
            values["comm_hidden"] = sync.overlap.hidden_fraction()  # since the last log
            sync.overlap.reset()
        values.update(self.pipeline_metrics(step))
        self._window_start, self._window_tokens = time.perf_counter(), 0
        return values

    # ------------------------------------------------------------------ pipeline
    def describe_pipeline(self) -> str | None:
        split = self.parallel.stage_split
        if split is None:
            return None
        step = self.parallel.step
        shape = step.shape
        blocks = ", ".join(f"s{i}: {len(b)}" for i, b in enumerate(split))
        return (f"pipeline: {step.schedule}, {shape.ranks} ranks x {shape.virtual} stage(s) each, "
                f"{shape.microbatches} micro-batches; blocks per stage {blocks}; "
                f"ideal bubble {ideal_bubble(step.schedule, shape):.3f} of compute time")

    def pipeline_metrics(self, step: int) -> dict[str, float]:
        """The measured bubble of a step the pipeline timed; its Chrome trace on the last step if asked."""
        events = getattr(self.parallel.step, "events", None)
        if events is None:
            return {}
        pipe = self.parallel.step
        bubble = measure_bubble(events)
        values = {"bubble": bubble.over_ideal, "bubble_ideal": ideal_bubble(pipe.schedule, pipe.shape)}
        if self.config.logging.pipeline_trace and step == self.config.train.steps and torch.distributed.get_rank() == 0:
            shape = pipe.shape
            info = {"schedule": pipe.schedule, "ranks": shape.ranks, "microbatches": shape.microbatches,
                    "virtual": shape.virtual, "step": step}
            path = write_chrome_trace(self.output_dir / "pipeline_trace.json", events, info)
            self._notes.append(f"pipeline trace: {path} (measured bubble {bubble.over_ideal:.3f}, "
                               f"ideal {values['bubble_ideal']:.3f} of compute time)")
        pipe.events = None
        return values
