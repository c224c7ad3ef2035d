"""The guard's verdict is the same on every rank: a NaN on one rank skips the step everywhere (issue item 4).

Rank 1 alone gets a NaN loss at step 3. The flag is OR-ed across ranks, so every rank skips that
step, and the run ends equal (fp32 parity tolerances, parity/harness.py) to one process that skips
the same step. Without the all-reduce, rank 0 would apply a NaN-free half of the gradient under
ZeRO (its shard) or the ranks would diverge.
"""

import pytest

from parity.harness import assert_parity, train_distributed, train_single, with_changes


@pytest.mark.parametrize("layout", [{}, {"shard": 2, "zero_stage": 2}], ids=["ddp", "zero2"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(base, tmp_path, layout):
    reference = train_single(with_changes(base, fault={"kind": "nan", "step": 3}))
    config = with_changes(base, train={"micro_batch_size": 4, "output_dir": str(tmp_path / "two")},
                          data_parallel=layout, fault={"kind": "nan", "step": 3, "rank": 1})
    losses, weights = train_distributed(config, 2)
    assert len(losses) == len(reference[0]) == 3  # steps 1, 2, 4: step 3 skipped on both ranks
    assert_parity(reference, (losses, weights))
