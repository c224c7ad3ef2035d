"""The CUDA paths on one GPU (skipped where there is none; CI never has one).

Run on a lent H100 for docs/gpu.md. Each test checks what the CPU suite cannot: training on CUDA
equals training on the CPU (fp32; cuBLAS and the CPU BLAS sum in different orders), the defaults
on CUDA (fused AdamW, SDPA's flash kernel for bf16 causal attention), compiled blocks without
recompiles, the chunked head's and the compiled loss's peak-memory savings, FP8 through torch._scaled_mm, the fused
kernels' parity with eager, and a grouped MoE block that never makes the host wait for the GPU.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fivefold.ops.fp8 import E4M3, E5M2, _fast_path, quantize, scaled_matmul
from fivefold.ops.fused import OPS, fused
from fivefold.ops.linear_cross_entropy import linear_cross_entropy
from fivefold.optim import build_optimizer
from fivefold.config import OptimConfig
from fivefold.parallel.compile import compiled_graphs, compiled_loss
from fivefold.parallel.output_loss import cross_entropy_sum
from fivefold.plan.estimate import logits_bytes
from fivefold.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _config(job, tmp_path, name, **train):
    return dataclasses.replace(job, train=dataclasses.replace(job.train, output_dir=str(tmp_path / name), **train))


def test_training_on_cuda_equals_training_on_the_cpu(job, tmp_path):
    cpu = Trainer(_config(job, tmp_path, "cpu", device="cpu"))
    gpu = Trainer(_config(job, tmp_path, "gpu", device="cuda"))
    assert next(gpu.model.parameters()).is_cuda
    expected = [cpu.train_step()["loss"] for _ in range(4)]
    losses = [gpu.train_step()["loss"] for _ in range(4)]
    print("cpu", expected, "cuda", losses)
    assert losses == pytest.approx(expected, rel=1e-4)


def test_bf16_chunked_compiled_fp8_training_on_cuda(job, tmp_path):
    torch._dynamo.reset()
    base = Trainer(_config(job, tmp_path, "bf16", device="cuda", dtype="bf16", micro_batch_size=8))
    fast = Trainer(_config(job, tmp_path, "fast", device="cuda", dtype="bf16", micro_batch_size=8, compile=True,
                           loss_chunk_tokens=64, fp8=True))
    expected = [base.train_step()["loss"] for _ in range(30)]
    losses = [fast.train_step()["loss"]]
    fast.evaluate()
    warm = compiled_graphs()
    losses += [fast.train_step()["loss"] for _ in range(29)]
    fast.evaluate()
    print(f"bf16 {expected[0]:.3f} -> {expected[-1]:.3f}; compile + chunked + fp8 {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert compiled_graphs() == warm
    assert expected[-1] < expected[0] - 1.5
    assert abs(sum(losses[-5:]) / 5 - sum(expected[-5:]) / 5) <= 0.05


@pytest.mark.parametrize("aux", ["switch", "sequence"])
def test_a_dropless_grouped_moe_block_on_cuda_never_waits_for_the_gpu_and_equals_the_loop_kernel(aux):
    """Under torch's sync debug mode set to `error` any host read of a device tensor raises: the grouped kernel's
    forward and backward (routing, counts, offsets, balancing and z losses, statistics) read none, so the host
    runs ahead of the GPU through every MoE layer. Its output and gradients equal the loop kernel's to bf16
    rounding (the loop kernel must read the counts, to slice its rows)."""
    import copy

    from fivefold.model.config import ModelConfig
    from fivefold.model.moe import MoE

    config = ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=32, n_experts=8, moe_top_k=2,
                         moe_ffn_dim=64, moe_aux_loss=aux, moe_aux_coeff=0.01, moe_z_loss_coeff=0.001)
    torch.manual_seed(0)
    grouped = MoE(config, 0).cuda()
    loop = copy.deepcopy(grouped)
    grouped.kernel.kind, loop.kernel.kind = "grouped", "loop"
    x = torch.randn(2, 32, 64, device="cuda")
    results = {}
    for name, moe in (("loop", loop), ("grouped", grouped)):
        inputs = x.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if name == "grouped" else "default")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = moe(inputs)
            (out.float() ** 2).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[name] = [out.float(), inputs.grad, *(p.grad for p in moe.parameters())]
    for a, b in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())
    stats = grouped.stats.take()
    assert stats.load.sum() == 2 * 32 * 2 and stats.aux_loss > 0 and stats.z_loss > 0


def test_fused_adamw_on_cuda_and_foreach_on_the_cpu():
    gpu = build_optimizer(torch.nn.Linear(4, 4, device="cuda"), OptimConfig())
    cpu = build_optimizer(torch.nn.Linear(4, 4), OptimConfig())
    assert gpu.defaults["fused"] and not cpu.defaults.get("fused")


def test_sdpa_runs_the_flash_kernel_for_bf16_causal_attention():
    from torch.profiler import ProfilerActivity, profile

    from fivefold.model.llama import attention_core

    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attention_core(q, k, v)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    print(names)
    assert any("flash" in name.lower() for name in names), names


def _peak_above_inputs(run, *leaves: torch.Tensor) -> tuple[int, torch.Tensor]:
    """CUDA bytes allocated at the peak of `run()` (a loss) and its backward, above what was allocated before;
    and the loss. The leaves' gradients are dropped first."""
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = run()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, loss.detach()


def _head_inputs(n: int, d: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(n, d, device="cuda", requires_grad=True)
    weight = (torch.randn(v, d, device="cuda") * 0.02).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), device="cuda")


def test_chunked_head_peak_memory_saving_on_cuda():
    n, d, v = 8192, 1024, 32000
    hidden, weight, labels = _head_inputs(n, d, v)

    def bf16(fn):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn()
        return run

    plain, expected = _peak_above_inputs(bf16(lambda: F.cross_entropy(F.linear(hidden, weight).float(), labels,
                                                                      reduction="sum")), hidden, weight)
    plain_grads = (hidden.grad.clone(), weight.grad.clone())
    chunked, loss = _peak_above_inputs(bf16(lambda: linear_cross_entropy(hidden, weight, labels, 1024)), hidden, weight)
    saving, formula = plain - chunked, logits_bytes(n, v, 1) - logits_bytes(n, v, 1, 1024)
    print(f"peak above the inputs: plain {plain / 2**20:.0f} MiB, chunked {chunked / 2**20:.0f} MiB; "
          f"saving {saving / 2**20:.0f} MiB, planner's logits term {formula / 2**20:.0f} MiB")
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert ((hidden.grad - plain_grads[0]).norm() / plain_grads[0].norm()).item() < 1e-2
    assert saving >= 4 * n * v  # at least the log-probabilities the plain loss keeps


def test_compiled_loss_peak_memory_saving_on_cuda():
    """bf16 logits: eager cross-entropy holds their fp32 copy and fp32 log-probabilities; compiled, only the
    bf16 logits, 8 bytes a token and the bf16 gradient (the planner's logits term with compiled_element=2)."""
    n, d, v = 8192, 1024, 32000
    hidden, weight, labels = _head_inputs(n, d, v)
    fast = compiled_loss()

    def head_then(loss_fn):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = F.linear(hidden, weight)
            return loss_fn(logits, labels)  # the logits live on only where the loss keeps them
        return run

    _peak_above_inputs(head_then(fast), hidden, weight)  # compiles (its workspace is not the loss's memory)
    plain, expected = _peak_above_inputs(head_then(cross_entropy_sum), hidden, weight)
    plain_grad = weight.grad.clone()
    compiled, loss = _peak_above_inputs(head_then(fast), hidden, weight)
    formula = logits_bytes(n, v, 1, compiled_element=2)
    around = 4 * v * d + 2 * v * d + 4 * n * d  # the weight's fp32 gradient and bf16 copy, the hidden gradient
    print(f"peak above the inputs: plain {plain / 2**20:.0f} MiB, compiled {compiled / 2**20:.0f} MiB; planner's "
          f"logits term plain {logits_bytes(n, v, 1) / 2**20:.0f} MiB, compiled {formula / 2**20:.0f} MiB "
          f"(+ {around / 2**20:.0f} MiB of gradients and the bf16 weight)")
    assert torch.allclose(loss, expected, rtol=1e-5)
    assert ((weight.grad - plain_grad).norm() / plain_grad.norm()).item() < 1e-2
    # the saving is the planner's: 12 N V eager against 4 N V + 8 N compiled (measured 2,000 MiB both, 2026-11-26)
    assert plain - compiled == pytest.approx(logits_bytes(n, v, 1) - formula, rel=0.05)
    assert compiled <= 1.1 * (formula + around)


def test_fp8_matmul_runs_on_the_tensor_cores_and_equals_the_emulation():
    a, b = torch.randn(256, 512, device="cuda"), torch.randn(512, 384, device="cuda")
    a8, a_inv = quantize(a, E4M3)
    b8, b_inv = quantize(b, E5M2)
    assert _fast_path(a8, b8)
    fast = scaled_matmul(a8, a_inv, b8, b_inv, torch.float32)
    emulated = (a8.float() * a_inv) @ (b8.float() * b_inv)
    # Hopper's FP8 tensor cores accumulate with fewer bits than fp32 (measured 1.0e-4 relative on an H100)
    assert ((fast - emulated).norm() / emulated.norm()).item() < 1e-3


@pytest.mark.parametrize("name", list(OPS))
def test_fused_kernels_equal_eager(name):
    tokens, dim = 512, 256
    if name == "rms_norm":
        args = (torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16), torch.randn(dim, device="cuda"), 1e-5)
    elif name == "swiglu":
        args = tuple(torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    else:
        args = (torch.randn(1, 4, tokens, 64, device="cuda", dtype=torch.bfloat16),
                torch.randn(tokens, 64, device="cuda"), torch.randn(tokens, 64, device="cuda"))
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
    eager, fast = OPS[name](*args), fused(OPS[name], "cuda")(*args)
    grad = torch.randn_like(eager)
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    expected = torch.autograd.grad(eager, inputs, grad)
    got = torch.autograd.grad(fast, inputs, grad)
    assert torch.allclose(fast.float(), eager.float(), rtol=1e-2, atol=1e-2)
    for g, e in zip(got, expected):
        assert ((g.float() - e.float()).norm() / e.float().norm()).item() < 1e-2


def test_zero_offload_keeps_masters_in_pinned_memory_and_matches_plain_adamw():
    """ZeRO-2 with offload over a one-rank NCCL group (one GPU: the group is real, the traffic trivial):
    masters and gradient landing buffers are page-locked, and three steps equal plain AdamW on the GPU."""
    import torch.distributed as dist

    from conftest import micro_model
    from fivefold.model import build_model, materialize
    from fivefold.optim import build_adamw
    from fivefold.parallel.zero import ZeroDataParallel
    from fivefold.parallel.zero_groups import ZeroGroups

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    tokens = torch.randint(0, 64, (2, 16), device="cuda")

    def train(offload: bool) -> torch.Tensor:
        model = materialize(build_model(micro_model(vocab_size=64)), "cuda")
        if offload:
            zero = ZeroDataParallel(model, ZeroGroups.over(dist.group.WORLD, None, 2), 2, torch.float32, torch.float32, True)
            assert zero.pinned and all(g.master.is_pinned() and g.host_grad.is_pinned() for g in zero.groups)
            optimizer = build_adamw(zero.master_parameters(True), zero.master_parameters(False), OptimConfig())
        else:
            optimizer = build_optimizer(model, OptimConfig())
        for _ in range(3):
            model(tokens).float().pow(2).mean().backward()
            if offload:
                zero.finish_gradient_sync()
                zero.prepare_step()
                optimizer.step()
                zero.after_step()
            else:
                optimizer.step()
                optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.allclose(train(True), train(False), atol=1e-5)
