"""Elastic resume (issue item 6): 4 -> 3 -> 2 data-parallel ranks, ZeRO-1, -2 and -3, the global batch kept.

A 6-step run with a global batch of 12 samples is interrupted twice, as a preempted job is: every
rank fails at once (`fault.rank = -1`) after the checkpoint of step 2 on 4 ranks (ZeRO-1,
accumulation 3), and after that of step 4 on 3 ranks (ZeRO-2); 2 ranks (ZeRO-3) finish it. Each
restart keeps train.grad_accum_steps as first configured; fivefold recomputes it (3 -> 4 -> 6) so
the global batch stays 12, and DCP reshards the optimizer states across ranks and stages. The
losses and the final weights must equal one uninterrupted process with micro-batches of 12,
within the parity tolerances (harness.py): the sampler hands the same 12 windows to each step
however they are split, and the schedule is the same 6-step schedule throughout.
"""

from pathlib import Path

import pytest

from fivefold.train.checkpoint import read_weights
from fivefold.train.metrics import read_metrics
from parity.harness import assert_parity, train_distributed, train_single, with_changes


def test_four_then_three_then_two_ranks_equal_one_uninterrupted_run(base, tmp_path):
    reference = train_single(with_changes(base, train={"steps": 6, "micro_batch_size": 12, "eval_every": 0,
                                                       "log_every": 1, "output_dir": str(tmp_path / "one")}))
    out = tmp_path / "elastic"
    run = with_changes(base, train={"steps": 6, "micro_batch_size": 1, "grad_accum_steps": 3, "eval_every": 0,
                                    "log_every": 1, "output_dir": str(out)}, checkpoint={"every": 2})
    for ranks, stage, crash in ((4, 1, 3), (3, 2, 5), (2, 3, None)):
        segment = with_changes(run, data_parallel={"shard": ranks, "zero_stage": stage},
                               checkpoint={"resume": "none" if ranks == 4 else "auto"},
                               fault={"kind": "exception", "step": crash, "rank": -1} if crash else {})
        if crash:
            with pytest.raises(RuntimeError, match=f"injected failure at step {crash}"):
                train_distributed(segment, ranks)
        else:
            train_distributed(segment, ranks)
    losses = [r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6
    assert_parity(reference, (losses, read_weights(out / "step-000006")))
