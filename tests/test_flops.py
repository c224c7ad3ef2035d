"""Parameter and FLOP formulas against the instantiated model and PyTorch's FLOP counter."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fivefold.model import PRESETS, build_model, get_preset, materialize
from fivefold.plan.flops import count_parameters, flops_per_token
from fivefold.plan.memory import adam_fp32, adam_mixed_precision

from conftest import micro_model

# Exact totals: the element counts of the published safetensors checkpoints (what the Hugging Face
# hub reports for each repository), and the figure its model card states, as written there.
PUBLISHED = {
    # preset: (exact total, model-card figure in billions, its decimals, non-embedding figure or None)
    "llama3-8b": (8_030_261_248, 8.0, 0, None),           # Meta-Llama-3-8B: "8B"
    "llama3-70b": (70_553_706_496, 70, 0, None),          # "70B"
    "llama3-405b": (405_853_388_800, 405, 0, None),       # Llama 3.1 405B: "405B"
    "llama3.1-8b": (8_030_261_248, 8, 0, None),           # Llama-3.1-8B: "8B"
    "llama3.1-70b": (70_553_706_496, 70, 0, None),        # "70B"
    "llama3.1-405b": (405_853_388_800, 405, 0, None),     # "405B"
    "llama3.2-1b": (1_235_814_400, 1.23, 2, None),        # Llama-3.2-1B card: "1.23B"
    "llama3.2-3b": (3_212_749_824, 3.21, 2, None),        # Llama-3.2-3B card: "3.21B"
    "qwen2.5-7b": (7_615_616_512, 7.61, 2, 6.53),         # Qwen2.5-7B card: 7.61B, non-embedding 6.53B
    "qwen3-8b": (8_190_735_360, 8.2, 1, 6.95),            # Qwen3-8B card: 8.2B, non-embedding 6.95B
    "qwen3-32b": (32_762_123_264, 32.8, 1, 31.2),         # Qwen3-32B card: 32.8B, non-embedding 31.2B
    "mistral-7b": (7_241_732_096, 7.24, 2, None),         # Mistral-7B-v0.1 checkpoint (the announcement rounds to "7.3B")
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_equals_instantiated_model_on_meta(name):
    config = get_preset(name)
    config.vocab_size = config.vocab_size or 257
    # every kind of block the preset has, twice: the count is a sum over blocks, and DeepSeek-V3's 58 MoE layers
    # of 256 experts take seconds to build even on the meta device (the published counts here and
    # test_mla.py's 671B check all the layers)
    config.n_layers = min(config.n_layers, config.moe_first_dense + 2 * config.moe_layer_freq)
    model = build_model(config)  # meta device: the 405B model costs no memory
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config).total


def _states(figure: float, decimals: int, count: int) -> bool:
    """A card figure with `decimals` decimals (in billions) states `count` if it is the count rounded or
    truncated to those decimals (cards do both: Llama 3.2 1B's 1.2358e9 is "1.23B", Qwen3-8B's 8.19e9 "8.2B")."""
    return abs(count / 1e9 - figure) < 10 ** -decimals


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_equal_the_published_ones(name):
    exact, card, decimals, non_embedding = PUBLISHED[name]
    counts = count_parameters(get_preset(name))
    assert counts.total == exact
    assert _states(card, decimals, counts.total)
    if non_embedding is not None:  # Qwen's cards count the embedding and the untied head as embedding
        assert _states(non_embedding, len(str(non_embedding).split(".")[1]), counts.total - counts.embedding - counts.head)


def test_gpt3_shape_is_175b_class():
    assert 174e9 < count_parameters(get_preset("gpt3-175b")).total < 176e9


FAMILY_OPTIONS = {
    "untied": {}, "tied": {"tie_embeddings": True},
    "qwen3-like": {"head_dim": 12, "qk_norm": "head", "attention_bias": "all"},
    "olmo2-like": {"qk_norm": "projection", "norm_position": "post", "mlp_bias": True},
}


@pytest.mark.parametrize("options", list(FAMILY_OPTIONS.values()), ids=list(FAMILY_OPTIONS))
def test_flops_per_token_equals_pytorch_flop_counter(options):
    """FlopCounterMode counts every matmul, forward and backward.

    PyTorch's counter has no formula for the fused CPU attention kernel, so attention runs on
    the math backend, whose two batched matmuls are counted (unmasked, as in PaLM).
    """
    config = micro_model(vocab_size=64, **options)
    model = materialize(build_model(config), "cpu", seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config).total
    batch, seq = 2, 24
    tokens = torch.randint(0, 64, (batch, seq))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).sum().backward()
    assert counter.get_total_flops() == flops_per_token(config, seq) * batch * seq


def test_flops_formula_palm():
    c = get_preset("llama3-8b")
    n = count_parameters(c)
    assert n.matmul == n.total - n.embedding - n.norms
    assert flops_per_token(c, 8192) == 6 * n.matmul + 12 * 32 * 32 * 128 * 8192


def test_model_state_bytes():
    assert adam_mixed_precision(10).total == 160
    assert adam_mixed_precision(10).optimizer == 120
    assert adam_fp32(10).total == 160 and adam_fp32(10).parameters == 40
