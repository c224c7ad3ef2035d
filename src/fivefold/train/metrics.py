"""Throughput, MFU, memory and the metric sinks (JSONL, TensorBoard, loss plot).

MFU (Chowdhery et al. 2022) = achieved model FLOP/s / peak FLOP/s, with model FLOPs per token
from `fivefold.plan.flops.flops_per_token` (6N + 12LHQT, no recompute counted). It is reported only
where the peak is known: the dense bf16 tensor-core rate of a known GPU, or `train.peak_tflops`.
A CPU has no published peak a short measurement could stand in for (a matmul timed while other
ranks start up reads low, and MFU then exceeds 100%), so on CPU the achieved model TFLOP/s per
rank is reported instead.

metrics.jsonl is only ever appended to: a run that starts or resumes writes a marker line
({"event": "resume", "step": N, ...}); `read_metrics` reads the file as one timeline, in which a
marker at step N replaces the earlier records past N, and skips a torn line (a crash mid-write)
with a notice.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

# Dense (non-sparse) bf16 peak TFLOP/s from vendor data sheets, matched by substring of the
# device name; more specific names first.
GPU_PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.5),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.5),
    ("H800", 989.5),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("MI300X", 1307.4),
    ("MI250X", 383.0),
)


def lookup_gpu_peak_tflops(device_name: str) -> float | None:
    for key, tflops in GPU_PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float | None, str]:
    """(peak TFLOP/s or None when unknown, where the number came from)."""
    if override > 0:
        return override, "train.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = lookup_gpu_peak_tflops(name)
        if found is not None:
            return found, f"{name} dense bf16 data sheet"
        return None, f"{name} is not in the peak table; set train.peak_tflops for MFU"
    return None, "no known peak for a CPU; set train.peak_tflops for MFU"


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


class MetricsLogger:
    """Append-only metrics.jsonl (with a start or resume marker) plus optional TensorBoard scalars."""

    def __init__(self, output_dir: Path, tensorboard: bool, start_step: int = 0, resumed_from: Path | None = None,
                 attempt: int = 0):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        torn = self.path.is_file() and self.path.stat().st_size > 0 and not self.path.read_bytes().endswith(b"\n")
        self._file = self.path.open("a")
        if torn:
            self._file.write("\n")  # end a line a crash cut off, so the marker starts a line of its own
        marker = {"event": "resume" if resumed_from else "start", "step": start_step, "attempt": attempt,
                  "time": time.time(), **({"resumed_from": str(resumed_from)} if resumed_from else {})}
        self._file.write(json.dumps(marker) + "\n")
        self._file.flush()
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def mark(self, event: str, step: int) -> None:
        """A timeline marker: the run continues from `step` (a rollback), later records replace those past it."""
        self._file.write(json.dumps({"event": event, "step": step, "time": time.time()}) + "\n")
        self._file.flush()

    def log(self, step: int, values: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: Path, notice: Callable[[str], None] | None = print) -> list[dict[str, Any]]:
    """The run's records as one timeline: markers applied, torn or damaged lines skipped (with a notice)."""
    if not path.is_file():
        return []
    records: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a metrics record")
        except ValueError:
            if notice is not None:
                notice(f"{path}:{number}: skipping a damaged line (a write cut off by a crash?): {line[:60]!r}")
            continue
        if "event" in record:
            records = [r for r in records if r["step"] <= record["step"]]
        else:
            records.append(record)
    return records


def plot_losses(metrics_path: Path, png_path: Path, baseline: float | None = None) -> Path:
    """Train and validation loss against step; the unigram baseline as a dashed line."""
    from fivefold.plotting import pyplot, save_figure

    plt = pyplot()

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, linestyle="--", color="gray", label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, png_path)
