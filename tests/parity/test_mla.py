"""Multi-latent attention trains like one process under tensor parallelism (with and without SP, with
selective recomputation of the attention core), pipeline parallelism, and in a DeepSeek-style model
(MLA + sigmoid-routed MoE with a shared expert and the bias step) at expert parallelism 2."""

import pytest

from parity.harness import TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes

MLA = dict(attention="mla", q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
DEEPSEEK_LIKE = dict(MLA, n_experts=4, moe_top_k=2, moe_ffn_dim=16, moe_shared_experts=1, moe_first_dense=1,
                     moe_score="sigmoid", moe_route_scale=2.5, moe_aux_loss="sequence", moe_bias_update_rate=0.01)

LAYOUTS = {
    "tp2": (MLA, 2, dict(tensor_parallel={"degree": 2}, train={"recompute": "selective"})),
    "tp2-sp": (dict(MLA, q_lora_rank=0), 2, dict(tensor_parallel={"degree": 2, "sequence_parallel": True})),
    "pp2": (MLA, 2, dict(train={"micro_batch_size": 4, "grad_accum_steps": 2}, pipeline_parallel={"degree": 2})),
    "deepseek-like-ep2-tp2-sp": (DEEPSEEK_LIKE, 4, dict(train={"micro_batch_size": 4}, expert_parallel={"degree": 2},
                                                        tensor_parallel={"degree": 2, "sequence_parallel": True})),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mla_trains_like_one_process(base, tmp_path, name):
    model, world, sections = LAYOUTS[name]
    single = with_changes(base, model=model)
    if name == "pp2":
        single = with_changes(single, train={"micro_batch_size": 4, "grad_accum_steps": 2})
    sections = {key: dict(value) for key, value in sections.items()}
    sections.setdefault("train", {})["output_dir"] = str(tmp_path / name)
    diffs = assert_parity(train_single(single), train_distributed(with_changes(single, **sections), world),
                          param_atol=TP_PARAM_ATOL)
    print(f"{name}: {diffs}")
