"""FP8 linear layers (ops/fp8.py): the quantisation, the three matmuls, the swap, and a short run.

The CPU path multiplies the very FP8 values the GPU's torch._scaled_mm would (same scales, same
casts), in fp32: the checks here fix those values exactly. A 30-step run of the micro model with
train.fp8 under bf16 autocast ends within 0.05 nats of the bf16 run (measured: see docs/gpu.md),
while both fall well below where they started.
"""

import dataclasses

import pytest
import torch

from fivefold.errors import ConfigError
from fivefold.model import build_model, materialize
from fivefold.ops.fp8 import E4M3, E5M2, Float8Linear, apply_fp8, fp8_linear, quantize
from fivefold.parallel.validate import check_config
from fivefold.train.trainer import Trainer

from conftest import micro_model


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_puts_the_largest_value_at_the_format_max(dtype):
    x = torch.randn(64, 64) * 3.0
    q, inverse = quantize(x, dtype)
    assert q.dtype == dtype
    assert q.float().abs().max().item() == torch.finfo(dtype).max
    back = q.float() * inverse
    mantissa = 3 if dtype == E4M3 else 2
    big = x.abs() > x.abs().max() / 64  # normal range of both formats after scaling
    assert ((back - x).abs()[big] <= x.abs()[big] * 2.0 ** -(mantissa + 1) * 1.0001).all()


def test_the_three_matmuls_use_the_quantised_operands():
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    grad = torch.randn(4, 8, 48)
    y = fp8_linear(x, w)
    y.backward(grad)

    def dq(t, dtype):
        q, inverse = quantize(t, dtype)
        return q.float() * inverse

    x2, g2 = x.detach().reshape(-1, 32), grad.reshape(-1, 48)
    assert torch.allclose(y.detach().reshape(-1, 48), dq(x2, E4M3) @ dq(w.detach(), E4M3).t(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad.reshape(-1, 32), dq(g2, E5M2) @ dq(w.detach(), E4M3), rtol=1e-6, atol=1e-6)
    assert torch.allclose(w.grad, dq(g2, E5M2).t() @ dq(x2, E4M3), rtol=1e-6, atol=1e-5)
    exact = x.detach() @ w.detach().t()
    assert 0 < ((y - exact).norm() / exact.norm()).item() < 0.08  # e4m3 rounding, not garbage


def test_swap_keeps_parameters_and_names_and_spares_head_router_and_embedding():
    model = materialize(build_model(micro_model(vocab_size=257)), "cpu")
    before = dict(model.named_parameters())
    swapped = apply_fp8(model)
    assert swapped == 2 * 7  # wq wk wv wo w1 w2 w3 per block
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert type(model.output) is torch.nn.Linear


def test_fp8_with_tensor_parallelism_is_refused(job):
    config = dataclasses.replace(job, train=dataclasses.replace(job.train, fp8=True),
                                 tensor_parallel=dataclasses.replace(job.tensor_parallel, degree=2))
    with pytest.raises(ConfigError, match="train.fp8"):
        check_config(config)


def test_fp8_training_tracks_bf16(job, tmp_path):
    def losses(fp8: bool) -> list[float]:
        train = dataclasses.replace(job.train, steps=30, micro_batch_size=8, dtype="bf16", fp8=fp8, eval_every=0,
                                    output_dir=str(tmp_path / f"fp8-{fp8}"))
        trainer = Trainer(dataclasses.replace(job, train=train))
        swapped = sum(isinstance(m, Float8Linear) for m in trainer.model.modules())
        assert swapped == (2 * 7 if fp8 else 0)
        return [trainer.train_step()["loss"] for _ in range(30)]

    bf16, fp8 = losses(False), losses(True)
    print(f"bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}; fp8 {fp8[0]:.3f} -> {fp8[-1]:.3f}")
    assert fp8 != bf16, "train.fp8 changed nothing"
    assert bf16[-1] < bf16[0] - 1.5
    assert abs(sum(fp8[-5:]) / 5 - sum(bf16[-5:]) / 5) <= 0.05
