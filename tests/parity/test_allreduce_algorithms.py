"""DDP whose buckets are summed by a hand-written all-reduce reproduces single-process training.

Every algorithm of `gradient_comm.allreduce_algorithm` at 4 ranks (hierarchical as 2 pretend nodes of
2), small buckets so several go through the communication thread while backward runs, with
gradient accumulation (same tolerances as DDP); and `auto` at 3 ranks (not a power of two).
"""

import pytest

from parity.harness import assert_parity, train_distributed, with_changes

ALGORITHMS = ["ring", "halving_doubling", "rabenseifner", "butterfly", "tree", "double_tree", "hierarchical", "torus"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hand_written_all_reduce_matches_single_process(base, reference, tmp_path, algorithm):
    run = with_changes(base, train={"micro_batch_size": 1, "grad_accum_steps": 2, "output_dir": str(tmp_path / algorithm)},
                       gradient_comm={"allreduce_algorithm": algorithm, "bucket_mb": 0.05, "node_size": 2})
    diffs = assert_parity(reference, train_distributed(run, 4))
    print(f"{algorithm} x4: {diffs}")


def test_auto_all_reduce_at_three_ranks_matches_native_ddp(job, tmp_path):
    """3 ranks (not a power of two): compared with the backend's all-reduce on the same layout.

    A 3-way split of this model's batch lands up to 1.6e-5 from one process after 3 steps with
    either reducer (Adam amplifies summation-order differences), so the reference here is native
    DDP at 3 ranks; auto stays within 2e-7 of it.
    """
    base = with_changes(job, train={"micro_batch_size": 2, "steps": 3, "eval_every": 3, "output_dir": str(tmp_path / "native")},
                        checkpoint={"every": 0}, gradient_comm={"bucket_mb": 0.05})
    native = train_distributed(base, 3)
    auto = with_changes(base, train={"output_dir": str(tmp_path / "auto")}, gradient_comm={"allreduce_algorithm": "auto"})
    assert_parity(native, train_distributed(auto, 3), param_atol=1e-6)
