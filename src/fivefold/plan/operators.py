"""Operators a transformer block dispatches per micro-batch: the count the host's fixed cost per block scales by.

A block pass costs its FLOPs at the achieved rate and its bytes at the memory bandwidth, plus a fixed host
cost (`Accelerator.pass_overhead_us`: Python, the dispatcher, kernel launches) that does not shrink with
the block's width. That cost is fitted on dense blocks, and it grows with the operators a pass runs, not
with its FLOPs: a mixture-of-experts block routes, sorts, counts, gathers, stacks its experts' weights,
runs them and sums their outputs back: about twice the operators of a dense block of the same width
(tiny-moe: 207 against 108 per forward and backward). So a MoE block's fixed cost is the dense block's
times the ratio of their operator counts. Views (`t`, `view`, `select`, `detach`, ...) are not counted:
they change a tensor's metadata only, launch nothing on a GPU and take about a microsecond on a CPU,
and a grouped GEMM over E experts would otherwise count some 3 E of them (DeepSeek-V3's 256 experts:
1,694 views beside 269 other operators). What a single operator runs inside (the CPU grouped GEMM's
loop of one matmul per expert) is not seen either.

The counts are the runtime's own: one block of each kind is built from the model's config at a small width
(heads, experts, top-k, routing and every switch kept; widths shrunk, which changes no operator) and run
forward and backward on one short sequence under a dispatch-mode counter, which sees every aten operator
the block's forward and its backward run (autograd's gradient accumulation included), views aside.
tests/test_planner.py checks that the small copy counts what the full-width block dispatches.
"""

from __future__ import annotations

import dataclasses
import functools

from fivefold.model.config import ModelConfig

_HEAD = 8  # width of each head in the small copy
_WIDTH = 16  # hidden width of its MLPs and experts, and MLA's low ranks


def small_copy(model: ModelConfig) -> ModelConfig:
    """`model` with every width shrunk and everything that decides which operators run kept."""
    return dataclasses.replace(
        model, dim=model.n_heads * _HEAD, head_dim=_HEAD, ffn_dim=_WIDTH, multiple_of=1, ffn_dim_multiplier=1.0,
        moe_ffn_dim=_WIDTH if model.n_experts else model.moe_ffn_dim,
        moe_shared_ffn_dim=_WIDTH if model.moe_shared_ffn_dim else 0,
        q_lora_rank=_WIDTH if model.q_lora_rank else 0, kv_lora_rank=_WIDTH, qk_nope_head_dim=_HEAD,
        qk_rope_head_dim=_HEAD, v_head_dim=_HEAD, vocab_size=64, init_from_hf="")


def count_block_operators(model: ModelConfig, layer: int, expert_kernel: str = "auto", seq: int = 16) -> int:
    """Aten operators other than views that block `layer` of `model` dispatches in one forward and backward of
    one sequence of `seq` tokens, with the given expert kernel (model/moe.py ExpertKernel)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.model.llama import TransformerBlock, rope_tables
    from fivefold.model.moe import ExpertKernel

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += not func.is_view
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    block = TransformerBlock(model, layer)
    if model.is_moe_layer(layer):
        block.feed_forward.kernel = ExpertKernel(expert_kernel)
    cos, sin = rope_tables(model, torch.device("cpu"))
    x = torch.randn(1, seq, model.dim, generator=generator, requires_grad=True)
    with Counter() as counter:
        block(x, cos[:seq], sin[:seq]).sum().backward()
    return counter.calls


def operator_ratio(model: ModelConfig, expert_kernel: str) -> float:
    """A MoE block's operators per micro-batch over a dense block's of the same model (1.0 without experts)."""
    if not model.n_experts:
        return 1.0
    return _operator_ratio(dataclasses.astuple(model), expert_kernel)


@functools.lru_cache(maxsize=64)  # a search prices thousands of layouts of one model: count it once
def _operator_ratio(fields: tuple, expert_kernel: str) -> float:
    small = small_copy(ModelConfig(*fields))
    moe = small.moe_layers[0]
    dense = dataclasses.replace(small, n_experts=0)
    return count_block_operators(small, moe, expert_kernel) / count_block_operators(dense, moe)
