"""ZeRO-3 really frees a block's gathered weights after its forward, though its matmuls saved them for backward.

A matmul saves its weight (a view of the gathered flat buffer) for backward; swapping the parameter's data
alone would leave that view holding the whole buffer until the block's backward, so every block's weights
would be resident at the end of the forward. The runtime releases the buffer's storage instead (FSDP's way)
and grows it again for the backward gather, which the saved views then read. Checked at the end of each
forward, with and without full recomputation (whose forward inside backward keeps the weights until the
block's gradients are reduced); that the numbers stay right is the ZeRO-3 parity tests' job. The most
gathered at once, at a block's forward, equals the planner's ZeRO-3 buffers up to the groups' padding:
that block, the next one being prefetched, and the rest of the model (embedding, final norm, head),
gathered from the forward to the end of the step. Under hpZ, the secondary shards every block keeps from
its forward to its backward (1/h of its weights) equal the planner's hpZ term up to the padding.
"""

import pytest

from distributed.spawn import run_distributed
from parity.harness import with_changes


def _gathered_bytes(rank, world_size, config):
    """(block bytes held at each forward's end, all of the model's, the most held at any block's forward, the
    planner's ZeRO-3 buffers, the most padding the flat groups can add, the hpZ secondary shards' bytes held at
    each forward's end, the planner's hpZ term)."""
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate
    from fivefold.train.trainer import Trainer

    trainer = Trainer(config)
    zero = trainer.sync.zero
    blocks = [g for g in zero.groups if g.unit < len(zero.units)]
    held, secondary, peak = [], [], [0]

    def gathered(groups) -> int:
        return sum(g.gathered.untyped_storage().nbytes() for g in groups if g.gathered is not None)

    def at_end(module, args, output):
        if module.training:
            held.append(gathered(blocks))
            secondary.append(sum(g.secondary.numel() * g.secondary.element_size()
                                 for g in blocks if g.secondary is not None))

    def in_block(module, args):  # after ZeRO's own pre-hook: this block gathered, the next one prefetching
        peak[0] = max(peak[0], gathered(zero.groups))

    trainer.model.register_forward_hook(at_end)
    for unit in zero.units:
        unit.register_forward_pre_hook(in_block)
    for _ in range(2):
        trainer.train_step()
    def planned_buffers(job) -> int:
        plan = estimate(job, world_size, PRESETS["h100-sxm"], vocab_size=trainer.model_config.vocab_size)
        return plan.per_pp_rank[0].buffers

    planned = planned_buffers(config)
    hpz = planned - planned_buffers(with_changes(config, data_parallel={"hpz_partition": 1}))
    padding = len(zero.groups) * (world_size - 1) * 4
    return held, sum(g.padded_numel for g in blocks) * 4, peak[0], planned, padding, secondary, hpz


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_zero3_releases_gathered_block_weights_after_forward(job, tmp_path, recompute):
    config = with_changes(job, data_parallel={"zero_stage": 3, "shard": 2}, checkpoint={"enabled": False},
                          train={"eval_every": 0, "grad_accum_steps": 2, "recompute": recompute,
                                 "output_dir": str(tmp_path / "run")})
    for held, whole, peak, planned, padding, secondary, hpz in run_distributed(_gathered_bytes, 2, config):
        assert whole > 0
        assert held == [0, 0, 0, 0]  # 2 steps x 2 micro-batches: no block's weights resident at the forward's end
        # the planner's buffers: two blocks (current, prefetched) and the rest of the model, up to the padding
        assert planned <= peak <= planned + padding, (peak, planned)
        assert secondary == [0, 0, 0, 0] and hpz == 0


def test_hpz_secondary_shards_held_through_the_forward_equal_the_planner(job, tmp_path):
    config = with_changes(job, data_parallel={"zero_stage": 3, "shard": 2, "hpz_partition": 2},
                          gradient_comm={"node_size": 2}, checkpoint={"enabled": False},
                          train={"eval_every": 0, "grad_accum_steps": 2, "output_dir": str(tmp_path / "run")})
    for held, whole, _, _, padding, secondary, hpz in run_distributed(_gathered_bytes, 2, config):
        assert held == [0, 0, 0, 0]
        # every block keeps 1/h of its weights from its forward to its backward: at the forward's end, all of them
        assert hpz > 0 and len(set(secondary)) == 1, secondary
        assert hpz <= secondary[0] <= hpz + padding // 2, (secondary, hpz)
        assert secondary[0] == whole // 2  # h = 2: half of every block's padded weights
