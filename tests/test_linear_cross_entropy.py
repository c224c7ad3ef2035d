"""The chunked LM head + cross-entropy (ops/linear_cross_entropy.py) against the plain head.

fp32: the loss and both gradients equal the plain F.linear + F.cross_entropy to 1e-6 (relative),
for chunks that divide the tokens, do not, or exceed them, with ignored labels. bf16 autocast: the
loss equal to 1e-6 (same bf16 matmul, fp32 softmax) and the gradients within 1e-2 (the weight
gradient is summed over chunks in fp32 where the plain head sums all tokens in one bf16 matmul).
The bytes kept for backward are exactly the formula: 4 N (one log-sum-exp per token) instead of
4 N V (the plain loss's log-probabilities), as the planner counts them.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import JobConfig
from fivefold.errors import ConfigError
from fivefold.ops.linear_cross_entropy import linear_cross_entropy
from fivefold.plan.estimate import logits_bytes
from fivefold.train.memory import saved_activation_bytes

N, D, V = 96, 16, 300


def _inputs():
    hidden = torch.randn(4, N // 4, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    labels = torch.randint(0, V, (4, N // 4))
    labels[0, :5] = -100
    return hidden, weight, labels


def _plain(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), labels.flatten(), reduction="sum")


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [1, 7, 32, 96, 1000])
def test_fp32_loss_and_gradients_equal_the_plain_head(chunk):
    hidden, weight, labels = _inputs()
    expected = _plain(hidden, weight, labels)
    grads = torch.autograd.grad(expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, labels, chunk)
    mine = torch.autograd.grad(loss, (hidden, weight))
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    assert max(_rel(a, b) for a, b in zip(mine, grads)) <= 1e-6
    assert mine[0].dtype == hidden.dtype and mine[1].dtype == weight.dtype


def test_bf16_autocast_matches_the_plain_head_within_bf16_rounding():
    hidden, weight, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _plain(hidden, weight, labels)
        loss = linear_cross_entropy(hidden, weight, labels, 32)
    grads = torch.autograd.grad(expected, (hidden, weight))
    mine = torch.autograd.grad(loss, (hidden, weight))
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    assert max(_rel(a, b) for a, b in zip(mine, grads)) <= 1e-2


def test_ignored_tokens_contribute_nothing():
    hidden, weight, labels = _inputs()
    labels[:] = -100
    loss = linear_cross_entropy(hidden, weight, labels, 10)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().max().item() == 0.0 and weight.grad.abs().max().item() == 0.0


def test_padded_vocabulary_rows_are_never_predicted():
    """Rows at or past vocab_size (tensor parallelism's padding) get no probability and no gradient."""
    hidden, weight, labels = _inputs()
    padded = torch.cat([weight.detach(), torch.randn(4, D) * 10]).requires_grad_()
    expected = _plain(hidden, weight, labels)
    loss = linear_cross_entropy(hidden, padded, labels, 32, vocab_size=V)
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * expected.item()
    assert padded.grad[V:].abs().max().item() == 0.0


def test_saved_bytes_are_the_formula():
    hidden, weight, labels = _inputs()
    plain = saved_activation_bytes(lambda: _plain(hidden, weight, labels), exclude=[hidden, weight, labels])
    chunked = saved_activation_bytes(lambda: linear_cross_entropy(hidden, weight, labels, 32),
                                     exclude=[hidden, weight, labels])
    assert chunked == 4 * N  # the log-sum-exp of each token
    assert plain - 4 == 4 * N * V  # the log-probabilities (and a 4-byte scalar)
    # the planner: one held micro-batch's kept bytes, plus the two live gradients (plain) or one chunk's (chunked)
    assert logits_bytes(N, V, held=1) - logits_bytes(N, V, held=1, chunk=32) == 3 * 4 * N * V - (4 * N + 2 * 4 * 32 * V)


def test_bad_chunk_is_refused():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk = 0"):
        linear_cross_entropy(hidden, weight, labels, 0)
    config = JobConfig()
    config.train.loss_chunk_tokens = -1
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        config.validate()


def test_the_training_loss_runs_the_head_in_the_training_dtype(job):
    """The step calls the loss outside autocast: OutputLoss must still run the head's matmuls in bf16."""
    from fivefold.model import build_model, materialize
    from fivefold.parallel.output_loss import OutputLoss

    model = materialize(build_model(dataclasses.replace(job.model, vocab_size=V)), "cpu")
    _, _, labels = _inputs()
    hidden = torch.randn(*labels.shape, job.model.dim)
    loss = OutputLoss(None, model, V, chunk_tokens=32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = linear_cross_entropy(hidden, model.head_weight, labels, 32)
    assert loss(hidden, labels).item() == expected.item()
    assert loss(hidden, labels).item() != linear_cross_entropy(hidden, model.head_weight, labels, 32).item()


@pytest.mark.parametrize("chunk", [0, 16])
def test_training_takes_the_chunked_head_exactly_when_asked(job, tmp_path, monkeypatch, chunk):
    """train.loss_chunk_tokens reaches the step: the model stops before its head and the chunked loss runs."""
    import fivefold.parallel.output_loss as output_loss
    from fivefold.train.trainer import Trainer

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[3])
        return linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(output_loss, "linear_cross_entropy", counting)
    train = dataclasses.replace(job.train, loss_chunk_tokens=chunk, output_dir=str(tmp_path / "run"))
    trainer = Trainer(dataclasses.replace(job, train=train))
    trainer.train_step()
    assert calls == ([chunk] * job.train.grad_accum_steps if chunk else [])
