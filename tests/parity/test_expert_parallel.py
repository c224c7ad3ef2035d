"""Mixture-of-experts training at every layout equals one process (docs/moe.md).

The MoE micro model (both layers MoE: 4 experts of width 32, top-2, a shared expert, switch loss and
z-loss) is trained 4 steps in one process and in each layout below; losses agree to rtol 1e-5 and
parameters to the tensor-parallel tolerance (1e-4: the expert outputs of a token are summed in
another order after the all-to-all, and DDP sums expert gradients over other groups).
"""

import json
from pathlib import Path

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
    "ep2-zero3-dp4": (4, dict(train={"micro_batch_size": 2}, data_parallel={"shard": 4, "zero_stage": 3},
                              expert_parallel={"degree": 2})),
    "ep2-zero1-dp4": (4, dict(train={"micro_batch_size": 2}, data_parallel={"shard": 4, "zero_stage": 1},
                              expert_parallel={"degree": 2})),
    "zero2-ep1-loop": (2, dict(train={"micro_batch_size": 4}, data_parallel={"shard": 2, "zero_stage": 2},
                                   expert_parallel={"degree": 1, "kernel": "loop"})),
    "ep2-pp2": (4, dict(train={"micro_batch_size": 4}, pipeline_parallel={"degree": 2, "schedule": "1f1b"},
                        expert_parallel={"degree": 2})),
    # expert tensor parallelism: every expert's hidden units split over 2 ranks
    "etp2": (2, dict(train={"micro_batch_size": 4}, expert_parallel={"tensor": 2})),
    "ep2-etp2": (4, dict(train={"micro_batch_size": 2}, expert_parallel={"degree": 2, "tensor": 2, "alltoall": "pairwise"})),
    "ep2-etp2-tp2-sp": (4, dict(train={"micro_batch_size": 4}, tensor_parallel={"degree": 2, "sequence_parallel": True},
                                expert_parallel={"degree": 2, "tensor": 2})),
    "etp2-zero3-dp4": (4, dict(train={"micro_batch_size": 2}, data_parallel={"shard": 4, "zero_stage": 3},
                               expert_parallel={"tensor": 2, "kernel": "loop"})),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_trains_like_one_process(base, tmp_path, name):
    world, sections = LAYOUTS[name]
    single = with_changes(base, model=MOE)
    if name == "ep2-pp2":  # layer 0 dense: the first pipeline stage holds no MoE layer at all
        single = with_changes(single, model={"moe_first_dense": 1})
    sections = {key: dict(value) for key, value in sections.items()}
    sections.setdefault("train", {})["output_dir"] = str(tmp_path / name)
    config = with_changes(single, **sections)
    diffs = assert_parity(train_single(single), train_distributed(config, world), param_atol=TP_PARAM_ATOL)
    # the clipped gradient norm counts every parameter once: expert pieces, replicas and TP shards included
    expected, got = _grad_norms(single), _grad_norms(config)
    assert len(expected) == len(got) >= 2 and got == pytest.approx(expected, rel=1e-5), (expected, got)
    print(f"{name}: {diffs} grad norms {got}")


def _grad_norms(config) -> list[float]:
    lines = (Path(config.train.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [row["grad_norm"] for row in map(json.loads, lines) if "grad_norm" in row]


VARIANTS = {
    # sigmoid scores + DeepSeek's bias balancing + sequence-wise loss + route scale, not renormalised
    "sigmoid-bias-sequence": dict(MOE, moe_score="sigmoid", moe_norm_topk=False, moe_route_scale=2.5,
                                  moe_aux_loss="sequence", moe_bias_update_rate=0.01),
    # capacity 1.0 per sequence drops assignments; by probability and by position
    "capacity-probability": dict(MOE, moe_capacity_factor=1.0, moe_drop_policy="probability"),
    "capacity-position": dict(MOE, moe_capacity_factor=0.5, moe_drop_policy="position", moe_shared_experts=0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_routing_variants_at_ep2_dp4(base, tmp_path, variant):
    """Drops are decided per sequence, so one process and 4 ranks (EP 2 x EDP 2) drop the same assignments;
    the bias moves identically on every rank from the all-reduced load."""
    single = with_changes(base, model=VARIANTS[variant])
    config = with_changes(single, train={"micro_batch_size": 2, "output_dir": str(tmp_path / variant)},
                          expert_parallel={"degree": 2})
    diffs = assert_parity(train_single(single), train_distributed(config, 4), param_atol=TP_PARAM_ATOL)
    print(f"{variant}: {diffs}")


def _train(config, world_size):
    return train_single(config) if world_size == 1 else train_distributed(config, world_size)


@pytest.mark.parametrize("saved,resumed", [
    ((4, dict(train={"micro_batch_size": 1}, expert_parallel={"degree": 4})), (1, {})),
    ((4, dict(train={"micro_batch_size": 2}, pipeline_parallel={"degree": 2}, expert_parallel={"degree": 2})),
     (2, dict(train={"micro_batch_size": 2}, expert_parallel={"degree": 2}))),
    ((4, dict(train={"micro_batch_size": 1}, expert_parallel={"degree": 2, "tensor": 2})), (1, {})),
    ((2, dict(train={"micro_batch_size": 2}, expert_parallel={"degree": 2})),
     (2, dict(train={"micro_batch_size": 2}, expert_parallel={"tensor": 2}))),
    ((4, dict(train={"micro_batch_size": 1}, data_parallel={"shard": 4, "zero_stage": 1}, expert_parallel={"tensor": 2})),
     (2, dict(train={"micro_batch_size": 2}, expert_parallel={"tensor": 2}))),
], ids=["ep4-to-ep1", "ep2xpp2-to-ep2", "ep2xetp2-to-ep1", "ep2-to-etp2", "etp2xzero1-to-etp2"])
def test_resume_at_another_expert_parallel_degree(base, tmp_path, saved, resumed):
    """Each expert is its own checkpoint group named by its global index, so any EP degree reads any other's;
    expert-tensor-parallel pieces are put back together and cut again at another ETP degree; the
    balancing biases travel in trainer.json. Saved at step 2 of 4, resumed, compared with the straight run."""
    model = dict(MOE, moe_bias_update_rate=0.01)
    (saved_world, saved_sections), (resumed_world, resumed_sections) = saved, resumed
    train = {"micro_batch_size": 4, "grad_accum_steps": 2}  # the global micro-batches every layout shares
    single = with_changes(base, model=model, train=train)
    straight = train_single(single)
    sections = {k: dict(v) for k, v in saved_sections.items()}
    sections["train"] = {**sections.get("train", {}), "output_dir": str(tmp_path / "saved")}
    first = with_changes(single, **sections, checkpoint={"every": 2, "keep_last": 2})
    _train(with_changes(first, train={"steps": 2}), saved_world)
    sections = {k: dict(v) for k, v in resumed_sections.items()}
    sections["train"] = {**sections.get("train", {}), "output_dir": str(tmp_path / "resumed")}
    again = with_changes(single, **sections, checkpoint={"resume": str(tmp_path / "saved" / "step-000002")})
    losses, weights = _train(again, resumed_world)
    diffs = assert_parity(straight, (straight[0][:2] + losses, weights), param_atol=TP_PARAM_ATOL)
    print(f"{saved_sections} -> {resumed_sections}: {diffs}")


@pytest.mark.parametrize("etp", [1, 2], ids=["ep2", "ep2-etp2"])
def test_load_aware_placement_with_replicas_trains_like_one_process(base, tmp_path, etp):
    """EPLB at EP 2: a skewed measured load (expert 0 hot) gives each rank one spare slot; expert 0 is
    replicated on both ranks, its assignments split between the replicas and its gradient summed over
    them (with ETP 2: each half over the ranks holding that half), so training equals one process."""
    import json

    from fivefold.parallel.expert_placement import place_experts

    load = [900.0, 50.0, 30.0, 20.0]
    trace = tmp_path / "trace" / "metrics.jsonl"
    trace.parent.mkdir()
    trace.write_text("".join(json.dumps({"step": s, "moe_load": {"0": load, "1": load}}) + "\n" for s in (1, 2)))
    placement = place_experts(load, 2, 3)
    assert all(0 in rank for rank in placement)
    single = with_changes(base, model=MOE)
    config = with_changes(single, train={"micro_batch_size": 4 // etp, "output_dir": str(tmp_path / "eplb")},
                          expert_parallel={"degree": 2, "tensor": etp, "replicas": 1, "load_from": str(trace.parent)})
    diffs = assert_parity(train_single(single), train_distributed(config, 2 * etp), param_atol=TP_PARAM_ATOL)
    print(f"eplb ep2 etp{etp}: {placement} {diffs}")
