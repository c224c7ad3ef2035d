"""The gradient-communication options reach the trainer's DDP and do their work (not just parity).

Parity alone cannot show an option took effect (native DDP is also correct), so each run reports
what its DDP used: the hand-written algorithm and node size that reduced the buckets, the codec
and its settings with the bytes it sent, and the priority schedule's negotiated slice order.
"""

from __future__ import annotations

import pytest

from distributed.spawn import run_distributed
from parity.harness import with_changes


def _facts(rank: int, world_size: int, config) -> dict:
    from fivefold.train.trainer import Trainer

    trainer = Trainer(config)
    trainer.fit()
    ddp = trainer.sync.ddp
    reducer = ddp.reducer
    facts = {"reducer": type(reducer).__name__, "ddp": type(ddp).__name__,
             "wire": ddp.last_wire_bytes, "bytes": ddp.gradient_bytes()}
    for name in ("choices", "node_size", "ratio", "block", "rank"):
        if hasattr(reducer, name):
            facts[name] = getattr(reducer, name)
    if hasattr(ddp, "order_log"):
        facts["orders"] = len(ddp.order_log)
        facts["slices"] = len(ddp.slices)
    return facts


@pytest.fixture
def two_steps(job, tmp_path):
    return with_changes(job, train={"steps": 2, "eval_every": 0, "micro_batch_size": 2, "output_dir": str(tmp_path / "run")},
                        checkpoint={"every": 0})


def test_hand_written_algorithm_and_node_size_are_used(two_steps):
    config = with_changes(two_steps, gradient_comm={"allreduce_algorithm": "hierarchical", "node_size": 2, "bucket_mb": 0.05})
    facts = run_distributed(_facts, 4, config)[0]
    assert facts["reducer"] == "AlgorithmReducer" and facts["node_size"] == 2
    assert facts["choices"] and set(facts["choices"].values()) == {"hierarchical"}


def test_codec_settings_reach_the_codec(two_steps):
    for codec, option, value, attribute in (("topk", "topk_ratio", 0.05, "ratio"), ("sign", "compression_block", 64, "block"),
                                            ("powersgd", "powersgd_rank", 3, "rank")):
        config = with_changes(two_steps, gradient_comm={"compression": codec, option: value},
                              train={"output_dir": f"{two_steps.train.output_dir}-{codec}"})  # one run per folder
        facts = run_distributed(_facts, 2, config)[0]
        assert facts[attribute] == value, codec
        assert 0 < facts["wire"] < facts["bytes"], codec  # fewer bytes than an fp32 all-reduce at p = 2 sends


def test_priority_schedule_is_used(two_steps):
    config = with_changes(two_steps, train={"max_grad_norm": 0.0},
                          gradient_comm={"schedule": "priority", "bucket_mb": 0.05, "slice_mb": 0.01})
    facts = run_distributed(_facts, 2, config)[0]
    assert facts["ddp"] == "PriorityDataParallel" and facts["orders"] == 2 and facts["slices"] > 10
