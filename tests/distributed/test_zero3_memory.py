"""ZeRO-3 really frees a block's gathered weights after its forward, though its matmuls saved them for backward.

A matmul saves its weight (a view of the gathered flat buffer) for backward; swapping the parameter's data
alone would leave that view holding the whole buffer until the block's backward, so every block's weights
would be resident at the end of the forward. The runtime releases the buffer's storage instead (FSDP's way)
and grows it again for the backward gather, which the saved views then read. Checked at the end of each
forward, with and without full recomputation (whose forward inside backward keeps the weights until the
block's gradients are reduced); that the numbers stay right is the ZeRO-3 parity tests' job.
"""

import pytest

from distributed.spawn import run_distributed
from parity.harness import with_changes


def _gathered_bytes_after_forward(rank, world_size, config):
    from fivefold.train.trainer import Trainer

    trainer = Trainer(config)
    zero = trainer.sync.zero
    blocks = [g for g in zero.groups if g.unit < len(zero.units)]
    held = []

    def check(module, args, output):
        if module.training:
            held.append(sum(g.gathered.untyped_storage().nbytes() for g in blocks if g.gathered is not None))

    trainer.model.register_forward_hook(check)
    for _ in range(2):
        trainer.train_step()
    return held, sum(g.padded_numel for g in blocks) * 4


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_zero3_releases_gathered_block_weights_after_forward(job, tmp_path, recompute):
    config = with_changes(job, data_parallel={"zero_stage": 3, "shard": 2}, checkpoint={"enabled": False},
                          train={"eval_every": 0, "grad_accum_steps": 2, "recompute": recompute,
                                 "output_dir": str(tmp_path / "run")})
    for held, whole in run_distributed(_gathered_bytes_after_forward, 2, config):
        assert whole > 0
        assert held == [0, 0, 0, 0]  # 2 steps x 2 micro-batches: no block's weights resident at the forward's end
