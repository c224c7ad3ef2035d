"""The compute model's width law (plan/efficiency.py `Efficiency.share`) and the GEMMs it prices (plan/gemms.py):
their FLOPs add up to the planner's count for every kind of block, each has the narrowest dimension one rank
runs, and the law with a vanishing half width is the plain model."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config import load_config
from fivefold.errors import ConfigError
from fivefold.model import get_preset
from fivefold.plan.cluster import PRESETS
from fivefold.plan.efficiency import Efficiency
from fivefold.plan.estimate import Degrees, _attention_core_flops, _block_forward_flops, degrees_of, estimate, pass_costs
from fivefold.plan.gemms import block_gemms, core_narrowest, head_gemm
from fivefold.plan.parameters import first_block
from fivefold.plan.published import SC21_TABLE1, sc21_config

A100 = PRESETS["a100-80gb"]


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen2.5-7b", "qwen3-8b", "gpt3-175b", "mixtral-8x7b",
                                    "qwen1.5-moe-a2.7b", "deepseek-v3"])
@pytest.mark.parametrize("tp,cp,sp", [(1, 1, False), (2, 1, False), (4, 2, True)])
def test_gemm_flops_add_up_to_the_blocks_count(preset, tp, cp, sp):
    """Attention projections (GQA, biases, qk-norm, MLA with its low-rank factors), dense and SwiGLU MLPs, the
    router, shared and routed experts: the listed GEMMs sum to `_block_forward_flops` less the attention core."""
    model = get_preset(preset)
    d = Degrees(1, 1, tp, cp, 1, 1, 1)
    tokens, seq = 2 * 4096, 4096
    for moe in (False, True):
        layer = first_block(model, moe)
        if layer < 0:
            continue
        gemms = block_gemms(model, layer, tokens, tp, cp, sp)
        expected = _block_forward_flops(model, layer, tokens, seq, d, sp) - _attention_core_flops(model, tokens, seq, d)
        assert sum(g.flops for g in gemms) == pytest.approx(expected, rel=1e-12), (preset, moe)
        assert all(g.flops >= 0 and g.narrowest >= 1 for g in gemms)
        assert any(g.routed for g in gemms) == moe


def test_each_gemm_has_the_shape_one_rank_runs():
    """Column-parallel projections narrow their N, row-parallel ones their K, to width / tp; the law reads the
    weight slice's narrower side, not the tokens (M)."""
    model = get_preset("llama3-8b")  # dim 4096, 32 heads of 128, 8 KV heads, MLP 14336
    shapes = {g.name: (g.m, g.k, g.n) for g in block_gemms(model, 0, 8192, 8, 2, False)}
    assert shapes == {"wq": (4096, 4096, 512), "wkv": (4096, 4096, 128), "wo": (4096, 512, 4096),
                      "w1 w3": (4096, 4096, 1792), "w2": (4096, 1792, 4096)}
    names = {g.name: g.narrowest for g in block_gemms(model, 0, 8192, 1, 1, False)}
    assert names == {"wq": 4096, "wkv": 1024, "wo": 4096, "w1 w3": 4096, "w2": 4096}
    assert {g.name: g.narrowest for g in block_gemms(model, 0, 256, 1, 1, False)} == names  # M does not narrow
    assert core_narrowest(model) == 128
    head = head_gemm(model, 8192, 8, 1)
    assert (head.k, head.n, head.narrowest) == (4096, 16032, 4096)  # 128,256 / 8 columns


def test_width_law_shares():
    law = Efficiency(0.7, 0.0, None, 300.0)
    assert law.share(300) == pytest.approx(0.35) and law.share(1e12) == pytest.approx(0.7)
    assert law.share(128) < law.share(768) < law.share(3200) < 0.7
    assert law.core_share(128) == law.share(128) and Efficiency(0.7, 0.2, None, 300.0).core_share(128) == 0.2
    assert Efficiency(0.7).share(128) == 0.7 and Efficiency(0.7).core_share(128) == 0.7
    assert "half at GEMM width 300" in law.describe()
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="half width"):
            Efficiency(0.5, 0.0, None, bad)


@pytest.mark.parametrize("overrides", [
    [], ["--tensor_parallel.degree", "2"],
    ["--model.n_experts", "4", "--model.moe_top_k", "2", "--expert_parallel.degree", "2"],
])
def test_a_vanishing_half_width_is_the_plain_model(overrides):
    """Every GEMM at `matmul` when the half width tends to 0: the same block, core, head and routed seconds."""
    config = load_config("configs/tiny.toml", ["--model.vocab_size", "257", *overrides])
    d = degrees_of(config, 4)
    plain = pass_costs(config, config.model, d, A100, Efficiency(0.5))
    law = pass_costs(config, config.model, d, A100, Efficiency(0.5, 0.0, None, 1e-9))
    assert law.block.keys() == plain.block.keys()
    for kind in plain.block:
        assert law.block[kind] == pytest.approx(plain.block[kind], rel=1e-6)
    for field in ("core", "head", "routed"):
        assert getattr(law, field) == pytest.approx(getattr(plain, field), rel=1e-6)


def test_width_law_prices_tensor_parallel_slices_and_narrow_heads_slower():
    """The published 18B block at tp 8 takes more than 1/8 of its tp-1 matmul seconds (its slices are narrower),
    by the law's ratio exactly; the attention core at head dimension 96 runs further from peak than at 128."""
    run = next(r for r in SC21_TABLE1 if r.name == "18B")
    law = Efficiency(0.7, 0.0, None, 300.0)
    config = sc21_config(run)
    model = config.model
    tokens = config.train.micro_batch_size * config.train.seq_len
    peak, seconds = A100.accelerator.peak_flops("bf16"), {}
    for tp in (1, 8):
        d = Degrees(1, 1, tp, 1, 1, 1, 1)
        gemms = block_gemms(model, 0, tokens, tp, 1, False)
        priced = pass_costs(config, model, d, A100, law)
        flat = pass_costs(config, model, d, A100, Efficiency(0.7, law.share(core_narrowest(model))))
        extra = sum(g.flops / (peak * law.share(g.narrowest)) - g.flops / (peak * 0.7) for g in gemms)
        assert priced.block[False] - flat.block[False] == pytest.approx(extra, rel=1e-6)
        seconds[tp] = sum(g.flops / (peak * law.share(g.narrowest)) for g in gemms)
    assert seconds[8] > seconds[1] / 8 * 1.05
    narrow = dataclasses.replace(model, n_heads=64, n_kv_heads=64)  # head dimension 96
    assert law.share(core_narrowest(narrow)) < law.share(core_narrowest(model))


def test_width_law_reaches_plan_and_simulate_from_the_command_line(capsys):
    """--half-width slows a tp-2 job's step (its GEMMs are narrow) in `fivefold plan` and `fivefold simulate`."""
    import json

    from fivefold.cli import main

    base = ["--cluster", "h100-sxm", "--config", "configs/tiny.toml", "--vocab-size", "257", "--gpus", "2",
            "--tensor_parallel.degree", "2", "--json"]
    assert main(["simulate", *base]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["simulate", *base, "--half-width", "256"]) == 0
    law = json.loads(capsys.readouterr().out)
    assert law["seconds"] > plain["seconds"] and law["half_width"] == 256 and plain["half_width"] == 0
    config = load_config("configs/tiny.toml", ["--tensor_parallel.degree", "2"])
    slow = estimate(config, 2, PRESETS["h100-sxm"], Efficiency(0.5, 0.0, None, 256), vocab_size=257)
    fast = estimate(config, 2, PRESETS["h100-sxm"], Efficiency(0.5), vocab_size=257)
    assert slow.time.compute > fast.time.compute
    assert main(["plan", *base[:-1], "--half-width", "-3"]) == 2
    assert "half width = -3.0" in capsys.readouterr().err
