"""train.compile: each transformer block and the loss compiled, same losses as eager, no recompiles after warm-up.

The first training step compiles the block graph (blocks of one shape share it), the first
evaluation its no_grad twin; from then on dynamo's counters must not move, step after step and
evaluation after evaluation. Losses of the compiled run stay within 1e-5 (relative) of eager fp32
(inductor reorders sums). CPU inductor takes a few seconds per graph here; on CUDA the same blocks
become Triton kernels (tests/test_cuda.py). The compiled loss equals the eager one (loss and logits
gradient, fp32 and bf16) and keeps what the planner's logits term says: the logits and 8 bytes a token,
where eager keeps 4 bytes per logit (its fp32 log-probabilities).
"""

import dataclasses

import pytest
import torch

from fivefold.parallel.compile import compiled_graphs, compiled_loss
from fivefold.parallel.output_loss import cross_entropy_sum
from fivefold.plan.estimate import logits_bytes
from fivefold.train.memory import saved_activation_bytes
from fivefold.train.trainer import Trainer


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_never_recompile(job, tmp_path):
    torch._dynamo.reset()
    eager = dataclasses.replace(job, train=dataclasses.replace(job.train, output_dir=str(tmp_path / "eager")))
    compiled = dataclasses.replace(job, train=dataclasses.replace(job.train, compile=True,
                                                                  output_dir=str(tmp_path / "compiled")))
    reference = Trainer(eager)
    expected = [reference.train_step()["loss"] for _ in range(4)]
    trainer = Trainer(compiled)
    assert trainer.step_fn.loss_sum.logits_loss._torchdynamo_orig_callable is cross_entropy_sum
    losses = [trainer.train_step()["loss"]]
    trainer.evaluate()
    warm = compiled_graphs()
    assert warm >= 4, "the block and loss graphs were not compiled for training and for evaluation"
    losses += [trainer.train_step()["loss"] for _ in range(3)]
    trainer.evaluate()
    assert compiled_graphs() == warm, "dynamo recompiled after the first step and evaluation"
    assert losses == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_equals_eager_and_keeps_the_planners_bytes(dtype):
    torch.manual_seed(0)
    batch, seq, vocab = 2, 48, 500
    tokens, element = batch * seq, torch.finfo(dtype).bits // 8
    logits = torch.randn(batch, seq, vocab, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, :7] = -100
    fast = compiled_loss()
    expected = cross_entropy_sum(logits, labels)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    got = fast(logits, labels)
    (grad,) = torch.autograd.grad(got, logits)
    assert got.dtype == torch.float32 and grad.dtype == dtype
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(grad.float(), expected_grad.float(), rtol=1e-2 if element == 2 else 1e-5, atol=1e-6)
    eager_kept = saved_activation_bytes(lambda: cross_entropy_sum(logits, labels), exclude=[logits, labels])
    kept = saved_activation_bytes(lambda: fast(logits, labels), exclude=[logits, labels])
    assert eager_kept - 4 == 4 * tokens * vocab  # fp32 log-probabilities (and a scalar)
    assert kept == 8 * tokens  # beside the logits themselves, which it keeps (excluded here)
    # the planner: kept logits + per-token bytes for one held micro-batch, plus the live gradient in the logits' dtype
    assert logits_bytes(tokens, vocab, 1, compiled_element=element) == (element * tokens * vocab + kept
                                                                          + element * tokens * vocab)
