"""Operators a transformer block dispatches per micro-batch: the count the host's fixed cost per block scales by.

A block pass costs its FLOPs at the achieved rate and its bytes at the memory bandwidth, plus a fixed host
cost (`Accelerator.pass_overhead_us`: Python, the dispatcher, kernel launches) that does not shrink with
the block's width. That cost is fitted on dense blocks, and it grows with the operators a pass runs, not
with its FLOPs: a mixture-of-experts block routes, sorts, counts, gathers, stacks its experts' weights,
runs them and sums their outputs back: about twice the operators of a dense block of the same width
(tiny-moe: 211 against 108 per forward and backward). So a MoE block's fixed cost is the dense block's
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

Ring attention (context parallelism, parallel/context_parallel.py) adds operators of its own to every block:
each visiting K/V block's partial attention and its merge, the stacked K/V, backward's gradient buffers and
their sums. They are counted the same way, the block's attention core replaced by the runtime's ring on a
loopback (`ContextParallelGroups.loopback`: each exchange hands back a copy of what it sends, no process
group) as ring rank 0, the busiest (every block it receives is later in the sequence: its queries' second
halves, copied out); the exchanges' own operators (the receive buffer, the send and the receive) are left out,
since posting an exchange is priced apart (`Accelerator.post_seconds`). tests/distributed/test_ring_operators.py
checks the count against ring rank 0 of a real ring. Ulysses' all-to-alls (and the 2D method's) are not
counted: their few reshapes are left in the fitted cost.

A count does not see what ring attention's two autograd functions do in Python between their operators (the
loop over the ring's steps, the slicing, the bookkeeping of what is in flight): on the small copy some 20
operators' worth per ring step (2026-11-28), more than the 31 operators a ring of 2 is counted to add. That is a
property of the host, so it is measured there (plan/ring_host.py, by `fivefold bench comm --cluster-file`,
stored as the accelerator's `ring_step_operators`) and added to the count (`ring_host_share`).
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


def count_block_operators(model: ModelConfig, layer: int, expert_kernel: str = "auto", seq: int = 16,
                          core=None) -> int:
    """Aten operators other than views that block `layer` of `model` dispatches in one forward and backward of
    one sequence of `seq` tokens, with the given expert kernel (model/moe.py ExpertKernel); `core` replaces its
    attention core (as parallel/context_parallel.py apply_context_parallel does)."""
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
    if core is not None:
        block.attention.core = core
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


def ring_attention_operators(model: ModelConfig, ring: int, inner: int = 0) -> float:
    """The operators ring attention over `ring` ranks (an inner ring of `inner`, 0: one ring) adds to a dense block's
    forward and backward, as a share of the block's own count (0.0 for no ring); the exchanges' own left out."""
    if ring < 2:
        return 0.0
    return _ring_attention_operators(dataclasses.astuple(model), ring, inner)


@functools.lru_cache(maxsize=64)
def _ring_attention_operators(fields: tuple, ring: int, inner: int) -> float:
    counted, posts, plain = ring_block_counts(ModelConfig(*fields), ring, inner)
    return max(0.0, (counted - 2 * posts - plain) / plain)  # each loopback exchange: a buffer and a copy


def dense_small_copy(model: ModelConfig) -> ModelConfig:
    """The small copy a ring is counted (and timed) on: a dense block, whatever layer kinds the model has."""
    return dataclasses.replace(small_copy(model), n_experts=0)


def loopback_ring(ring: int, inner: int = 0):
    """Ring attention on a loopback (no process group), as ring rank 0 runs it: the core that replaces a block's."""
    from fivefold.parallel.context_parallel import ContextParallelAttention, ContextParallelGroups, ContextParallelLayout

    groups = ContextParallelGroups(ContextParallelLayout(ring=ring, heads=1, inner=inner), 0, None, None, list(range(ring)),
                                   loopback=True)
    return ContextParallelAttention(groups)


def ring_block_counts(model: ModelConfig, ring: int, inner: int = 0) -> tuple[int, int, int]:
    """(operators of a dense block of the small copy with ring attention as its core, the loopback exchanges it
    posted, operators of the same block without the ring), per forward and backward."""
    small = dense_small_copy(model)
    core = loopback_ring(ring, inner)
    counted = count_block_operators(small, 0, core=core)
    return counted, core.groups.posts, count_block_operators(small, 0)


def dense_block_operators(model: ModelConfig) -> int:
    """Operators a dense block of `model`'s small copy dispatches in a forward and backward (the unit of
    `ring_host_share`)."""
    return _dense_block_operators(dataclasses.astuple(model))


@functools.lru_cache(maxsize=64)
def _dense_block_operators(fields: tuple) -> int:
    return count_block_operators(dense_small_copy(ModelConfig(*fields)), 0)


def ring_host_share(model: ModelConfig, ring: int, step_operators: float) -> float:
    """The host time ring attention's own Python adds to a block's forward and backward beyond its operators: `ring`
    steps of `step_operators` (the accelerator's `ring_step_operators`, measured by plan/ring_host.py) as a share
    of a dense block's operators; 0 without a ring."""
    if ring < 2 or not step_operators:
        return 0.0
    return ring * step_operators / dense_block_operators(model)
