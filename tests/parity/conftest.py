"""Fixtures of the parity tests: the single-process reference run every layout is compared with."""

import pytest

from parity.harness import train_single, with_changes


@pytest.fixture
def base(job, tmp_path):
    """4 steps, global batch 8 = micro 8 x accum 1 in one process; layouts split it their way."""
    return with_changes(job, train={"micro_batch_size": 8, "steps": 4, "eval_every": 4, "output_dir": str(tmp_path / "single")},
                        checkpoint={"every": 0})


@pytest.fixture
def reference(base):
    """(losses, final weights) of the single-process run."""
    return train_single(base)
