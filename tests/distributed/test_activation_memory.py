"""Activation bytes a block keeps for backward, measured with saved_tensors_hooks == the derived formula.

The formula (plan/activations.py, docs/activation_memory.md) is checked for no parallelism,
tensor parallelism at t = 2 (kv heads split) and t = 4 (kv heads replicated), with and without
sequence parallelism, and for each recomputation mode; and for a head width set explicitly
(head_dim 24: queries 96 wide on a 64-wide model, as Qwen3 does).
"""

import dataclasses

import pytest
import torch

from fivefold.model import ModelConfig, build_model, materialize
from fivefold.plan.activations import ActivationShape, block_activation_elements

from distributed.spawn import run_distributed

MODEL = ModelConfig(name="act", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64,
                    vocab_size=101)
WIDE_HEADS = dataclasses.replace(MODEL, name="act-head-dim", head_dim=24)
BATCH, SEQ = 2, 32
MODES = ("none", "selective", "full")


def _measure(tp: int, sp: bool, recompute: str, mesh=None, config: ModelConfig = MODEL) -> int:
    from fivefold.config import TensorParallelConfig
    from fivefold.parallel.mesh import Mesh
    from fivefold.parallel.parallelize import apply_model_parallel
    from fivefold.train.memory import saved_activation_bytes

    model = materialize(build_model(config), "cpu", seed=0)
    apply_model_parallel(model, mesh or Mesh.single(), TensorParallelConfig(tp, sp), recompute=recompute)
    block = model.layers["0"]
    seq = SEQ // tp if sp else SEQ
    x = torch.randn(BATCH, seq, config.dim).requires_grad_()
    positions = torch.arange(SEQ)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    return saved_activation_bytes(lambda: block(x, cos, sin), exclude=list(model.parameters()))


def _expected(tp: int, sp: bool, recompute: str, config: ModelConfig = MODEL) -> int:
    return 4 * block_activation_elements(config, ActivationShape(BATCH, SEQ, tp, sp, recompute))  # fp32


@pytest.mark.parametrize("config", [MODEL, WIDE_HEADS], ids=["plain", "head_dim"])
@pytest.mark.parametrize("recompute", MODES)
def test_single_process(recompute, config):
    assert _measure(1, False, recompute, config=config) == _expected(1, False, recompute, config)


def _tp_rank(rank, world_size, sp, config):
    from fivefold.parallel.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(tp=world_size, world_size=world_size), "cpu")
    return {mode: _measure(world_size, sp, mode, mesh, config) for mode in MODES}


@pytest.mark.parametrize("tp,sp,config", [(2, False, MODEL), (2, True, MODEL), (4, False, MODEL), (4, True, MODEL),
                                          (2, False, WIDE_HEADS), (2, True, WIDE_HEADS)],
                         ids=["tp2", "tp2-sp", "tp4", "tp4-sp", "tp2-head_dim", "tp2-sp-head_dim"])
def test_tensor_parallel(tp, sp, config):
    for measured in run_distributed(_tp_rank, tp, sp, config):
        assert measured == {mode: _expected(tp, sp, mode, config) for mode in MODES}


def test_recomputation_saves_what_it_should():
    none, selective, full = (_expected(1, False, m) for m in MODES)
    assert full < selective < none
    assert _expected(2, True, "none") < _expected(2, False, "none") < none
