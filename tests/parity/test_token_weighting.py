"""Token weighting across data-parallel ranks that hold different numbers of target tokens.

Labels of every token whose input id is divisible by 3 are masked, a rule that depends only on
the token, so every layout masks the same positions, while each rank ends up with its own count.
The loss is normalised by the step's token count over all ranks, so DDP and ZeRO must give the
single-process gradient exactly: the gradient norm (which, unlike Adam's update, keeps the
gradient's scale) and the losses must match. Normalising by each rank's own count instead, or
averaging per-rank means, changes the norm and fails this test.
"""

import pytest

from distributed.spawn import run_distributed
from parity.harness import LOSS_RTOL, with_changes

GRAD_NORM_RTOL = 1e-5


def _masked_trainer(config):
    from fivefold.parallel.tensor_parallel import IGNORE_INDEX
    from fivefold.train.trainer import Trainer

    class Masked(Trainer):
        def _local(self, inputs, labels):
            labels = labels.clone()
            labels[inputs % 3 == 0] = IGNORE_INDEX
            return super()._local(inputs, labels)

    return Masked(config)


def _steps(rank: int, world_size: int, config) -> tuple[list[float], list[float], int]:
    trainer = _masked_trainer(config)
    metrics = [trainer.train_step() for _ in range(config.train.steps)]
    mine = sum(int((labels != -100).sum()) for _, labels, _ in trainer.micro_batches(0))
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], mine


@pytest.mark.parametrize("data_parallel", [{}, {"shard": 2, "zero_stage": 2}], ids=["ddp", "zero2"])
def test_uneven_tokens_per_rank_give_the_single_process_gradient(base, tmp_path, data_parallel):
    single = with_changes(base, train={"steps": 2, "max_grad_norm": 0.0, "output_dir": str(tmp_path / "one")})
    losses, norms, _ = _steps(0, 1, single)
    split = with_changes(single, train={"micro_batch_size": 2, "grad_accum_steps": 2, "output_dir": str(tmp_path / "dp")},
                         data_parallel=data_parallel)
    results = run_distributed(_steps, 2, split)
    assert results[0][2] != results[1][2], "the ranks should hold different numbers of target tokens"
    for rank_losses, rank_norms, _ in results:
        assert rank_losses == pytest.approx(losses, rel=LOSS_RTOL)
        assert rank_norms == pytest.approx(norms, rel=GRAD_NORM_RTOL)
