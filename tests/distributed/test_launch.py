"""The launcher: `fivefold train --nproc-per-node N` trains under torchrun; a failing rank ends the job promptly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed.cli import run_cli

TESTS = Path(__file__).parent.parent


@pytest.mark.slow
def test_train_with_two_ranks_through_torchrun(tmp_path, corpus_dir):
    out = run_cli([
        "train", "--nproc-per-node", "2", "--data.source", str(corpus_dir), "--data.cache_dir", str(tmp_path / "cache"),
        "--data.val_fraction", "0.2", "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
        "--train.steps", "3", "--train.seq_len", "32", "--train.micro_batch_size", "2", "--train.peak_tflops", "1",
        "--train.output_dir", str(tmp_path / "run"), "--logging.progress", "false", "--logging.tensorboard", "false",
        "--logging.sample_tokens", "0",
    ], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 rank(s), dp 2" in out.stdout
    assert (tmp_path / "run" / "step-000003" / "meta.json").is_file()


def test_bad_parallel_config_fails_before_launch(tmp_path):
    out = run_cli(["train", "--nproc-per-node", "2", "--data_parallel.replicate", "3"], tmp_path, timeout=60)
    assert out.returncode == 2
    assert "dp_replicate 3" in out.stderr and "world size is 2" in out.stderr


@pytest.mark.slow
def test_failing_rank_ends_the_job_with_its_traceback():
    """Rank 0 is blocked in an all-reduce rank 1 never joins: without the agent it would hang for gloo's 30 min."""
    code = "import sys; from fivefold.train.launch import launch; sys.exit(launch(2, [], module='distributed.failing_rank'))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(TESTS)},
                         capture_output=True, text=True, timeout=120)  # a hang fails here
    assert out.returncode == 1  # the first failure's exit code, not the SIGTERM of the rank torchrun stopped after it
    assert "injected failure on rank 1" in out.stderr
    assert "rank 1 exited with code 1" in out.stderr, out.stderr[-2000:]
