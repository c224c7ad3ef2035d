"""ZeRO++ pieces that need no process group: block quantisation, the node groups, the config's checks,
and what the planner makes of each switch."""

import dataclasses

import pytest
import torch

from fivefold.config import JobConfig
from fivefold.errors import ConfigError
from fivefold.parallel.zero_pp import dequantize_rows, hpz_rows, node_rows, quantize_rows
from fivefold.plan.zero_traffic import quantized_bytes


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantisation_is_within_half_a_step_and_exact_on_its_grid(bits):
    top = 127 if bits == 8 else 7
    x = torch.randn(3, 1000)
    codes, scales = quantize_rows(x, bits, 64)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 1024 * bits // 8) and scales.shape == (3, 16)
    back = dequantize_rows(codes, scales, bits, 64, 1000)
    step = scales.repeat_interleave(64, dim=1)[:, :1000]
    assert ((back - x).abs() <= step / 2 * 1.0001).all()
    grid = torch.randint(-top, top + 1, (2, 128)).float() * 0.25
    grid[:, 0], grid[:, 64] = top * 0.25, -top * 0.25  # each block's max sets the scale to 0.25
    assert torch.equal(dequantize_rows(*quantize_rows(grid, bits, 64), bits, 64, 128), grid)
    assert quantized_bytes(1000, bits, 64) == codes[0].numel() + 4 * 16


def test_zero_blocks_and_padding_stay_zero():
    x = torch.zeros(1, 10)
    assert torch.equal(dequantize_rows(*quantize_rows(x, 4, 8), 4, 8, 10), x)


def test_node_rows_form_the_two_level_grid_and_refuse_ragged_nodes():
    intra, inter = node_rows([[0, 1, 2, 3], [4, 5, 6, 7]], node_size=2)
    assert intra == [[0, 1], [2, 3], [4, 5], [6, 7]] and inter == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert node_rows([[0, 2, 4, 6]], node_size=4) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    with pytest.raises(ConfigError, match="same number on every node"):
        node_rows([[0, 1, 2]], node_size=2)


def test_hpz_rows_stay_inside_a_node():
    assert hpz_rows([[0, 1, 2, 3]], 2, node_size=2) == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="different nodes"):
        hpz_rows([[0, 1, 2, 3]], 4, node_size=2)
    with pytest.raises(ConfigError, match="must divide"):
        hpz_rows([[0, 1, 2, 3]], 3, node_size=4)


@pytest.mark.parametrize("changes, message", [
    ({"zero_stage": 2, "shard": 2, "quantized_weights": True}, "zero_stage = 3"),
    ({"zero_stage": 1, "shard": 2, "hpz_partition": 2}, "zero_stage = 3"),
    ({"zero_stage": 3, "shard": 2, "quantized_gradients": "int2"}, "quantized_gradients"),
    ({"zero_stage": 3, "shard": 2, "quantization_block": 12}, "multiple of 8"),
    ({"zero_stage": 3, "shard": 4, "hpz_partition": 3}, "must divide"),
    ({"zero_stage": 3, "shard": 4, "hpz_partition": 0}, "positive"),
])
def test_config_refuses_zero_pp_where_it_cannot_work(changes, message):
    config = JobConfig()
    config.data_parallel = dataclasses.replace(config.data_parallel, **changes)
    with pytest.raises(ConfigError, match=message):
        config.validate()


def _plan(**options):
    from fivefold.model import ModelConfig
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate

    config = JobConfig()
    config.model = ModelConfig(name="plan", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                               max_seq_len=4096)
    config.train = dataclasses.replace(config.train, seq_len=4096, micro_batch_size=1, dtype="bf16")
    config.data_parallel = dataclasses.replace(config.data_parallel, zero_stage=3, shard=64, replicate=1,
                                               param_dtype="bf16", **options)
    _plan.config = config.validate()
    return estimate(config, 64, PRESETS["h100-sxm"], 0.4, simulate=False)


def test_the_planner_prices_each_switch():
    plain, qwz, hpz, qgz = _plan(), _plan(quantized_weights=True), _plan(hpz_partition=8), \
        _plan(quantized_gradients="int4")
    assert qwz.time.dp < plain.time.dp
    assert hpz.time.dp < plain.time.dp
    assert qgz.time.dp < plain.time.dp
    # hpZ keeps 1/h of every block's bf16 weights between forward and backward: the model's own block parameters
    from fivefold.model import build_model

    model = build_model(_plan.config.model)  # meta device: shapes only
    blocks = sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers."))
    assert hpz.memory.buffers - plain.memory.buffers == 2 * blocks // 8
