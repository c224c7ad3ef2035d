"""Mixture-of-experts training at every layout equals one process (docs/moe.md).

The MoE micro model (4 experts of width 32, top-2, a shared expert, switch loss and z-loss, 2 of
whose... both layers MoE) is trained 4 steps in one process and in each layout below; losses agree
to rtol 1e-5 and parameters to the tensor-parallel tolerance (1e-4: the expert outputs of a token
are summed in another order after the all-to-all, and DDP sums expert gradients over other groups).
"""

import pytest

from parity.harness import TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes

MOE = dict(n_experts=4, moe_top_k=2, moe_ffn_dim=32, moe_shared_experts=1, moe_aux_loss="switch",
           moe_aux_coeff=0.01, moe_z_loss_coeff=0.001)

LAYOUTS = {
    "ep2": (2, dict(train={"micro_batch_size": 4}, expert_parallel={"degree": 2})),
    "ep4": (4, dict(train={"micro_batch_size": 2}, expert_parallel={"degree": 4, "alltoall": "pairwise"})),
    "ep2-dp4": (4, dict(train={"micro_batch_size": 2}, expert_parallel={"degree": 2})),
    "ep2-tp2-sp": (2, dict(tensor_parallel={"degree": 2, "sequence_parallel": True}, expert_parallel={"degree": 2})),
    "ep2-tp2-dp2": (4, dict(train={"micro_batch_size": 4}, tensor_parallel={"degree": 2}, expert_parallel={"degree": 2})),
    "ep2-cp2": (2, dict(context_parallel={"degree": 2}, expert_parallel={"degree": 2})),
    "ep2-pp2": (4, dict(train={"micro_batch_size": 4}, pipeline_parallel={"degree": 2, "schedule": "1f1b"},
                        expert_parallel={"degree": 2})),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_trains_like_one_process(base, tmp_path, name):
    world, sections = LAYOUTS[name]
    single = with_changes(base, model=MOE)
    sections = {key: dict(value) for key, value in sections.items()}
    sections.setdefault("train", {})["output_dir"] = str(tmp_path / name)
    config = with_changes(single, **sections)
    diffs = assert_parity(train_single(single), train_distributed(config, world), param_atol=TP_PARAM_ATOL)
    print(f"{name}: {diffs}")
