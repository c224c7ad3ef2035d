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
