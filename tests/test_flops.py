"""Parameter and FLOP formulas against the instantiated model and PyTorch's FLOP counter."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fivefold.model import PRESETS, build_model, get_preset, materialize
from fivefold.plan.flops import count_parameters, flops_per_token
from fivefold.plan.memory import adam_fp32, adam_mixed_precision

from conftest import micro_model

KNOWN_TOTALS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_equals_instantiated_model_on_meta(name):
    config = get_preset(name)
    config.vocab_size = config.vocab_size or 257
    model = build_model(config)  # meta device: the 405B model costs no memory
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config).total


@pytest.mark.parametrize("name,total", KNOWN_TOTALS.items())
def test_llama3_published_parameter_counts(name, total):
    assert count_parameters(get_preset(name)).total == total


def test_gpt3_shape_is_175b_class():
    assert 174e9 < count_parameters(get_preset("gpt3-175b")).total < 176e9


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_equals_pytorch_flop_counter(tied):
    """FlopCounterMode counts every matmul, forward and backward.

    PyTorch's counter has no formula for the fused CPU attention kernel, so attention runs on
    the math backend, whose two batched matmuls are counted (unmasked, as in PaLM).
    """
    config = micro_model(vocab_size=64, tie_embeddings=tied)
    model = materialize(build_model(config), "cpu", seed=0)
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
