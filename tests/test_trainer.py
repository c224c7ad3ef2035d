"""The single-process trainer: learning, accumulation, schedule, clipping, precision, outputs."""

import dataclasses
import json
import math

import pytest
import torch

from fivefold.config import OptimConfig
from fivefold.plan.flops import flops_per_token
from fivefold.train.memory import saved_activation_bytes
from fivefold.train.metrics import lookup_gpu_peak_tflops, peak_tflops
from fivefold.optim import lr_at
from fivefold.train.trainer import IGNORE_INDEX, Trainer


def with_train(job, **changes):
    job.train = dataclasses.replace(job.train, **changes)
    return job


def test_loss_falls(job):
    job = with_train(job, steps=12)
    trainer = Trainer(job)
    losses = [trainer.train_step()["loss"] for _ in range(12)]
    assert losses[-1] < losses[0] - 0.5


def test_grad_accumulation_equals_one_big_batch(job):
    """micro 8 x accum 1 vs micro 2 x accum 4: same global batch, same losses and parameters.

    Losses and gradient norms agree to rtol 1e-5. Parameters after Adam agree to atol 1e-5
    (a thousandth of lr): Adam's m / sqrt(v) turns last-bit summation-order differences of
    near-zero gradients into differences of up to ~lr on those few elements.
    """
    big = Trainer(with_train(job, micro_batch_size=8, grad_accum_steps=1))
    small = Trainer(with_train(dataclasses.replace(job), micro_batch_size=2, grad_accum_steps=4))
    for _ in range(3):
        a, b = big.train_step(), small.train_step()
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for pa, pb in zip(big.model.parameters(), small.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-5)


def test_token_weighted_normalisation_with_uneven_micro_batches(job, monkeypatch):
    """Micro-batches with different numbers of target tokens still give the full-batch gradient."""
    def masked(trainer, step, accum):
        batches = Trainer.micro_batches(trainer, step)
        inputs = torch.cat([x for x, _, _ in batches])
        labels = torch.cat([y for _, y, _ in batches]).clone()
        labels[0, :30] = IGNORE_INDEX  # first sample nearly empty, the others full
        labels[1, 5:] = IGNORE_INDEX
        n = len(inputs) // accum
        return [(inputs[i * n : (i + 1) * n], labels[i * n : (i + 1) * n], None) for i in range(accum)]

    whole = Trainer(with_train(job, micro_batch_size=4, grad_accum_steps=1))
    split = Trainer(with_train(dataclasses.replace(job), micro_batch_size=1, grad_accum_steps=4))
    monkeypatch.setattr(whole, "micro_batches", lambda step: masked(whole, step, 1))
    monkeypatch.setattr(split, "micro_batches", lambda step: masked(split, step, 4))
    a, b = whole.train_step(), split.train_step()
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for pa, pb in zip(whole.model.parameters(), split.model.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-5)


def test_lr_schedule():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(109, cfg, 110) == pytest.approx(0.1)
    mid = 10 + 99 / 2
    assert lr_at(int(mid), cfg, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (int(mid) - 10) / 99)))
    assert lr_at(109, dataclasses.replace(cfg, schedule="linear"), 110) == pytest.approx(0.1)
    assert lr_at(50, dataclasses.replace(cfg, schedule="constant"), 110) == 1.0


def test_learning_rate_reaches_the_optimizer(job):
    trainer = Trainer(with_train(job, steps=4))
    for step in range(3):
        values = trainer.train_step()
        assert trainer.optimizer.param_groups[0]["lr"] == values["lr"] == lr_at(step, job.optim, 4)


def test_gradient_clipping_limits_the_update(job):
    clipped = Trainer(with_train(job, max_grad_norm=1e-4))
    free = Trainer(with_train(dataclasses.replace(job), max_grad_norm=0.0))
    before = [p.detach().clone() for p in clipped.model.parameters()]
    assert clipped.train_step()["grad_norm"] == pytest.approx(free.train_step()["grad_norm"], rel=1e-6)
    # Adam normalises the step size, so compare the first moments: they hold the clipped gradients.
    m_clipped = torch.cat([clipped.optimizer.state[p]["exp_avg"].flatten() for p in clipped.model.parameters()])
    m_free = torch.cat([free.optimizer.state[p]["exp_avg"].flatten() for p in free.model.parameters()])
    assert (m_clipped.norm() / (1 - 0.9)).item() == pytest.approx(1e-4, rel=1e-3)
    assert m_free.norm() > 100 * m_clipped.norm()
    assert any(not torch.equal(a, p) for a, p in zip(before, clipped.model.parameters()))


def test_bf16_autocast_is_close_but_not_identical(job):
    fp32 = Trainer(job).train_step()["loss"]
    bf16 = Trainer(dataclasses.replace(job, train=dataclasses.replace(job.train, dtype="bf16"))).train_step()["loss"]
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, abs=0.05)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_logits_are_freed_before_backward(job, monkeypatch, dtype):
    """The step drops its reference to the model's output once the loss is taken: the loss keeps what its backward
    needs (the log-probabilities), so the logits themselves (e x tokens x vocab bytes; 2 GiB of a 1B model's
    bf16 step on an H200, docs/planner.md) are gone before backward starts."""
    import weakref

    trainer = Trainer(with_train(job, dtype=dtype, grad_accum_steps=2))
    outputs, alive = [], []
    trainer.model.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    backward = torch.Tensor.backward

    def checked(self, *args, **kwargs):
        alive.append(outputs[-1]() is not None)
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", checked)
    trainer.train_step()
    assert alive == [False, False]  # each micro-batch's


def test_eval_is_deterministic_and_token_weighted(job):
    trainer = Trainer(job)
    assert trainer.evaluate() == trainer.evaluate()
    assert trainer.evaluate() == pytest.approx(math.log(257), abs=0.1)  # untrained: near uniform


def test_fit_writes_metrics_plot_tensorboard_and_sample(job):
    job.logging = dataclasses.replace(job.logging, tensorboard=True, plot=True, sample_prompt="def ", sample_tokens=10)
    result = Trainer(job).fit()
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert {"lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib"} <= set(train[0])
    flops = flops_per_token(dataclasses.replace(job.model, vocab_size=257), job.train.seq_len)
    assert train[0]["mfu"] == pytest.approx(flops * train[0]["tokens_per_s"] / 1e12)  # peak_tflops = 1
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert result.plot_path.stat().st_size > 1000
    assert list((result.metrics_path.parent / "tensorboard").glob("events.out.tfevents.*"))
    assert result.sample.startswith("def ")
    assert result.val_loss < math.log(257) - 0.5  # learned something in 6 steps


def test_peak_flops_table_and_sources():
    assert lookup_gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.5
    assert lookup_gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert lookup_gpu_peak_tflops("NVIDIA H200") == 989.5
    assert lookup_gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert lookup_gpu_peak_tflops("Some Future Chip") is None
    assert peak_tflops(torch.device("cpu"), 2.5) == (2.5, "train.peak_tflops")
    unknown, source = peak_tflops(torch.device("cpu"))
    assert unknown is None and "train.peak_tflops" in source  # no invented CPU peak: MFU is not reported


def test_without_a_known_peak_mfu_is_not_reported_but_achieved_tflops_are(job):
    """MFU was once above 100% with a peak measured under load; without a known peak there is no MFU."""
    job.train = dataclasses.replace(job.train, peak_tflops=0.0, device="cpu")  # a GPU has a data-sheet peak
    result = Trainer(job).fit()
    train = [r for r in map(json.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    assert all("mfu" not in r and r["tflops"] > 0 for r in train)
    flops = flops_per_token(dataclasses.replace(job.model, vocab_size=257), job.train.seq_len)
    assert train[0]["tflops"] == pytest.approx(flops * train[0]["tokens_per_s"] / 1e12)


def _saved_bytes(trainer) -> int:
    """Bytes autograd keeps for backward during one training forward of the trainer's model."""
    inputs, labels, _ = trainer.micro_batches(0)[0]
    return saved_activation_bytes(lambda: trainer.model(inputs), exclude=list(trainer.model.parameters()))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_training_and_keeps_less(job, tmp_path, mode):
    """Recomputation changes what is kept for backward (fewer bytes: a no-op would fail), not the result."""
    job.checkpoint = dataclasses.replace(job.checkpoint, every=0)
    plain = Trainer(job)
    again = dataclasses.replace(job, train=dataclasses.replace(job.train, output_dir=str(tmp_path / mode), recompute=mode))
    recomputed = Trainer(again)
    kept, plain_kept = _saved_bytes(recomputed), _saved_bytes(plain)
    assert kept < plain_kept, f"{mode} recompute keeps {kept} B, no recompute {plain_kept} B"
    if mode == "full":  # each block keeps only its input
        assert kept < plain_kept / 3
    assert recomputed.fit().losses == pytest.approx(plain.fit().losses, rel=1e-6)


def test_clipping_scales_every_gradient_as_one_multiply_each():
    """clip_ (parallel/gradient_sync.py) scales the gradients in one foreach kernel: equal bit for bit to
    multiplying each tensor, over mixed dtypes, and untouched at or under the limit."""
    from fivefold.parallel.gradient_sync import clip_

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(37, 5, generator=generator), torch.randn(3, generator=generator).bfloat16(),
             torch.randn(100, generator=generator)]
    expected = [g.clone().mul_(1.5 / (4.0 + 1e-6)) for g in grads]
    kept = [g.clone() for g in grads]
    clip_(grads, 1.0, 1.5)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept))
    clip_(grads, 4.0, 1.5)
    assert all(g.dtype == e.dtype and torch.equal(g, e) for g, e in zip(grads, expected))
    clip_([], 4.0, 1.5)


@pytest.mark.parametrize("max_norm", [0.5, 50.0, float("inf")])
def test_whole_gradients_clip_as_torch_does_and_skip_the_multiply_under_the_limit(max_norm):
    """clip_whole_ (the syncs whose ranks hold whole gradients: no parallelism, DDP, asynchronous parameter-server
    workers) returns torch's clip_grad_norm_ norm and gradients bit for bit, and runs no multiply when the norm is
    at or under the limit (train.max_grad_norm = 0 clips at inf): the planner prices only the norm then."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.parallel.gradient_sync import clip_whole_

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(40, 30, generator=generator), torch.randn(7, generator=generator)]
    ours, theirs = ([torch.nn.Parameter(torch.zeros_like(g)) for g in grads] for _ in range(2))
    for a, b, g in zip(ours, theirs, grads):
        a.grad, b.grad = g.clone(), g.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(theirs, max_norm))
    with Ops() as ops:
        norm = clip_whole_(ours, max_norm)
    assert norm == expected and all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
    multiplies = [name for name in ops.names if "mul" in name]
    assert bool(multiplies) == (norm > max_norm), ops.names


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_closed_trainer_is_freed_when_dropped_without_a_garbage_collection(job, dtype):
    """Nothing a trainer's parts keep points back at it (its printer and autocast factory are plain functions) and
    its sync's hooks are gone after close, so dropping it frees the model and the optimizer's states at once:
    on a GPU their memory is free for the next trainer, not held until a garbage collection finds a cycle."""
    import gc
    import weakref

    import torch._dynamo  # noqa: F401 - torch imports it lazily on a first model build, from a frame cycle of its own

    config = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, enabled=False),
                                 train=dataclasses.replace(job.train, dtype=dtype, grad_accum_steps=2))
    gc.collect()
    gc.disable()
    try:
        trainer = Trainer(config)
        trainer.train_step()
        alive = [weakref.ref(x) for x in (trainer, trainer.model, next(trainer.model.parameters()), trainer.optimizer)]
        trainer.close()
        del trainer
        assert [ref() is None for ref in alive] == [True] * 4
    finally:
        gc.enable()
