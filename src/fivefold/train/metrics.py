"""Throughput, MFU, memory and the metric sinks (JSONL, TensorBoard, loss plot).

MFU (Chowdhery et al. 2022) = achieved model FLOP/s / peak FLOP/s, with model FLOPs per token
from `fivefold.plan.flops.flops_per_token` (6N + 12LHQT, no recompute counted). Peak is the
dense bf16 tensor-core rate for known GPUs, or for a CPU either `train.peak_tflops` or a
short measured fp32 matmul rate.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

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


def measure_matmul_tflops(device: torch.device, size: int = 1024, seconds: float = 0.5) -> float:
    """Achieved fp32 matmul TFLOP/s on this device: the CPU's practical peak."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * count / (time.perf_counter() - start) / 1e12


def peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s, where the number came from)."""
    if override > 0:
        return override, "train.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = lookup_gpu_peak_tflops(name)
        if found is not None:
            return found, f"{name} dense bf16 data sheet"
    return measure_matmul_tflops(device), f"measured {device.type} fp32 matmul"


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


class MetricsLogger:
    """Append-only metrics.jsonl plus optional TensorBoard scalars."""

    def __init__(self, output_dir: Path, tensorboard: bool):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(output_dir / "tensorboard"))

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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path, baseline: float | None = None) -> Path:
    """Train and validation loss against step; the unigram baseline as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path
