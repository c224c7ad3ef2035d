"""Benchmarks run and report (no timing assertions: performance is measured, not asserted)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_model_throughput_runs_and_prints_result():
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_throughput.py"), "--layers", "1", "--batch", "1",
         "--seq-len", "16", "--rounds", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=240, check=True,
    ).stdout
    result = [line for line in out.splitlines() if line.startswith("RESULT name=model_throughput")]
    assert len(result) == 1 and "ratio=" in result[0]


@pytest.mark.slow
def test_data_parallel_benchmark_runs_and_prints_result():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_parallel.py"), "--world-sizes", "2", "--layers", "1",
         "--seq-len", "16", "--batch", "1", "--rounds", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    result = [line for line in out.splitlines() if line.startswith("RESULT name=data_parallel")]
    assert len(result) == 1 and "ours-zero3_vs_fsdp2_x2_mem=" in result[0]


@pytest.mark.slow
def test_tensor_parallel_benchmark_runs_and_prints_result():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--layers", "1", "--seq-len", "16",
         "--batch", "1", "--rounds", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    result = [line for line in out.splitlines() if line.startswith("RESULT name=tensor_parallel")]
    assert len(result) == 1 and "ours-tp_vs_dtensor-tp_time=" in result[0]
