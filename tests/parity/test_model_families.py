"""Each open model family's options train in every fold exactly like one process.

One small model per family (the micro model of conftest with that family's options) is trained
for 4 steps at tp 2 with sequence parallelism, at pp 2 (1F1B, 2 micro-batches) and under ZeRO-3
at dp 2, and compared with single-process training (losses rtol 1e-5; parameters within the
harness's tolerances). What each layout must get right for each family:

    llama3.1  llama3 RoPE scaling (factor 8 over a 16-token original context, so it changes angles at seq 32)
    qwen2     q/k/v biases: split with the rows of column-parallel layers
    qwen3     per-head q/k RMSNorm (gain replicated, gradient summed over TP) and head_dim 12 != dim / heads
    mistral   sliding window 8 < seq_len 32 (and every context-parallel method)
    olmo2     q/k RMSNorm over the whole projection (sum of squares all-reduced over TP), norms after each
              branch (the branch input enters the TP region by a hook)
"""

import pytest

from parity.harness import TP_PARAM_ATOL, assert_parity, train_distributed, train_single, with_changes

FAMILIES = {
    "llama3.1": dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=16, rope_theta=500000.0),
    "qwen2": dict(attention_bias="qkv"),
    "qwen3": dict(qk_norm="head", head_dim=12),
    "mistral": dict(sliding_window=8),
    "olmo2": dict(qk_norm="projection", norm_position="post"),
}

LAYOUTS = {
    "tp2-sp": (2, dict(tensor_parallel={"degree": 2, "sequence_parallel": True})),
    "pp2": (2, dict(train={"micro_batch_size": 4, "grad_accum_steps": 2},
                    pipeline_parallel={"degree": 2, "schedule": "1f1b"})),
    "zero3-dp2": (2, dict(train={"micro_batch_size": 4}, data_parallel={"shard": 2, "zero_stage": 3})),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_like_one_process_in_every_fold(base, tmp_path, family):
    single = with_changes(base, model=FAMILIES[family])
    reference = train_single(single)
    for name, (world, sections) in LAYOUTS.items():
        sections = {key: dict(value) for key, value in sections.items()}
        sections.setdefault("train", {})["output_dir"] = str(tmp_path / name)
        config = with_changes(single, **sections)
        diffs = assert_parity(reference, train_distributed(config, world), param_atol=TP_PARAM_ATOL)
        print(f"{family} {name}: {diffs}")


@pytest.mark.parametrize("method,cp,heads", [("ulysses", 2, 1), ("ring", 2, 1), ("ring", 4, 1), ("2d", 4, 2)])
def test_sliding_window_with_context_parallelism(base, tmp_path, method, cp, heads):
    """Window 8 over seq 32: Ulysses attends whole sequences; ring attention masks each visiting zigzag
    block by its positions (at cp 4 the chunks are 4 long, so some blocks are out of every query's
    window and skipped)."""
    single = with_changes(base, model=FAMILIES["mistral"])
    config = with_changes(single, train={"output_dir": str(tmp_path / "cp")},
                          context_parallel={"degree": cp, "method": method, "heads": heads})
    diffs = assert_parity(train_single(single), train_distributed(config, cp), param_atol=TP_PARAM_ATOL)
    print(f"mistral {method} cp{cp}: {diffs}")


@pytest.mark.parametrize("family", ["qwen2", "olmo2"])
def test_replicated_key_value_head_at_tp2(base, tmp_path, family):
    """n_kv_heads = 1 < tp: the one key/value head (its bias, its projection norm) is replicated on both
    ranks, its gradient summed over the replicas, and OLMo 2's k-norm counts its sum of squares once."""
    single = with_changes(base, model={**FAMILIES[family], "n_kv_heads": 1})
    config = with_changes(single, train={"output_dir": str(tmp_path / "tp")}, tensor_parallel={"degree": 2})
    diffs = assert_parity(train_single(single), train_distributed(config, 2), param_atol=TP_PARAM_ATOL)
    print(f"{family} kv 1 tp2: {diffs}")
