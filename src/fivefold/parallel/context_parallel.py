"""Context parallelism: causal attention over a sequence split across cp ranks.

Three methods, one implementation. The cp ranks are arranged as a (ring, heads) grid,
cp = ring x heads, head-parallel ranks innermost (their all-to-alls are the heavier traffic):

    ring     (Liu et al. 2023, ring attention; heads = 1): key/value blocks travel around the
             ring by asynchronous point-to-point, each step's transfer overlapped with the
             previous block's computation; partial softmax results are merged by their
             log-sum-exp (the online softmax of Milakov & Gimelshein 2018 / FlashAttention);
             the backward pass runs the same ring, the key/value gradients travelling with
             their block and arriving home after one more hop.
    ulysses  (Jacobs et al. 2023, DeepSpeed-Ulysses; ring = 1): an all-to-all turns the
             sequence-sharded q, k, v into head-sharded ones over the whole sequence, local
             attention runs, and the inverse all-to-all turns the output back.
    2d       (Gu et al. 2024, LoongTrain's head x context parallelism): Ulysses inside each
             group of `heads` ranks, ring attention across the `ring` groups.

Sharding (`shard_positions`): the sequence is cut into 2 x ring chunks and ring rank i holds
chunks i and 2 ring - 1 - i ("zigzag"), so under the causal mask every ring rank does the same
work: at ring step j > 0 a rank attends either all its queries to the first half of the
visiting block (the block came from an earlier rank) or the second half of its queries to
the whole block (a later rank), one half-block each. The ring rank's two chunks are then cut
into `heads` equal pieces, one per head-parallel rank, so that the Ulysses all-to-all
reassembles exactly the ring rank's zigzag sequence. Token positions travel with the tokens
(RoPE reads them), and labels are sharded the same way; the trainer weights the loss by the
token count summed over data- and context-parallel ranks, and sums gradients over both.

Communication per attention layer and micro-batch, with b s h the batch, sequence and
hidden sizes and kv the key/value share of h (GQA), in elements moved per rank:
ring: forward 2 (ring-1)/ring x b s kv x ring... see docs/context_parallel.md for the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig

CP_METHODS = ("ring", "ulysses", "2d")


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ContextParallelLayout:
    """cp = ring x heads ranks; cp rank p is ring rank p // heads, head-parallel rank p % heads."""

    ring: int = 1
    heads: int = 1

    @property
    def cp(self) -> int:
        return self.ring * self.heads

    @classmethod
    def for_method(cls, method: str, cp: int, cp_heads: int) -> "ContextParallelLayout":
        if method == "ring":
            return cls(ring=cp, heads=1)
        if method == "ulysses":
            return cls(ring=1, heads=cp)
        return cls(ring=cp // cp_heads, heads=cp_heads)

    def shard_positions(self, seq_len: int, cp_rank: int) -> torch.Tensor:
        """Positions (token indices) of the sequence that cp rank `cp_rank` holds, in local order."""
        ring_rank, head_rank = divmod(cp_rank, self.heads)
        if self.ring == 1:
            ring_local = torch.arange(seq_len)
        else:
            chunk = seq_len // (2 * self.ring)
            first, second = ring_rank, 2 * self.ring - 1 - ring_rank
            ring_local = torch.cat((torch.arange(first * chunk, (first + 1) * chunk),
                                    torch.arange(second * chunk, (second + 1) * chunk)))
        piece = ring_local.numel() // self.heads
        return ring_local[head_rank * piece:(head_rank + 1) * piece]


def check_context_parallel(config: ModelConfig, cp: int, method: str, cp_heads: int, tp: int, seq_len: int) -> None:
    """Raise ConfigError, naming the setting, when the sequence or heads cannot be split this way."""
    if method not in CP_METHODS:
        raise ConfigError(f"parallel.cp_method = {method!r} is not one of {', '.join(CP_METHODS)}")
    if cp < 1:
        raise ConfigError(f"parallel.cp = {cp}: must be a positive integer")
    if cp == 1:
        return
    if method == "2d" and (cp_heads < 1 or cp % cp_heads):
        raise ConfigError(f"parallel.cp_heads = {cp_heads} must divide parallel.cp = {cp} "
                          "(2d attention runs cp_heads-way Ulysses inside cp / cp_heads-way ring)")
    layout = ContextParallelLayout.for_method(method, cp, cp_heads)
    if layout.ring > 1 and seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp = {cp} ({method}) cuts train.seq_len = {seq_len} into 2 x cp = {2 * cp} "
                          "load-balanced chunks: make seq_len a multiple of 2 x cp")
    if seq_len % cp:
        raise ConfigError(f"parallel.cp = {cp} must divide train.seq_len = {seq_len}")
    local_heads = config.n_heads // tp
    if layout.heads > 1 and local_heads % layout.heads:
        raise ConfigError(f"{method} attention splits the {local_heads} query heads per tensor-parallel rank "
                          f"(model.n_heads {config.n_heads} / tp {tp}) over {layout.heads} ranks: "
                          "choose a head-parallel degree (parallel.cp, or parallel.cp_heads for 2d) that divides them")


# ----------------------------------------------------------------------------- groups
@dataclass
class ContextParallelGroups:
    """The process groups one rank's attention uses: its head-parallel group and its ring."""

    layout: ContextParallelLayout
    cp_rank: int
    head_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    ring_ranks: list[int]  # global ranks of this rank's ring, in ring order

    @property
    def ring_rank(self) -> int:
        return self.cp_rank // self.layout.heads


def build_context_parallel_groups(cp_rank_table: torch.Tensor, layout: ContextParallelLayout) -> ContextParallelGroups:
    """Create the head and ring groups of every cp group (collective: all ranks, same order).

    `cp_rank_table` lists the global ranks of every cp group, one row per group, in cp-rank order.
    """
    me = dist.get_rank()
    mine = None
    for row in cp_rank_table.tolist():
        grid = [row[i * layout.heads:(i + 1) * layout.heads] for i in range(layout.ring)]  # [ring][head]
        for ranks in grid:
            group = dist.new_group(ranks) if layout.heads > 1 else None
            if me in ranks:
                mine = dict(mine or {}, head_group=group)
        for head in range(layout.heads):
            ranks = [grid[i][head] for i in range(layout.ring)]
            group = dist.new_group(ranks) if layout.ring > 1 else None
            if me in ranks:
                mine = dict(mine or {}, ring_group=group, ring_ranks=ranks)
        if me in row:
            mine["cp_rank"] = row.index(me)
    return ContextParallelGroups(layout=layout, **mine)


# ----------------------------------------------------------------------------- Ulysses all-to-all
def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(b, h, s/n, d) sequence-sharded -> (b, h/n, s, d) head-sharded, over n ranks."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.view(b, n, h // n, s, d).transpose(0, 1)  # (n: destination, b, h/n, s, d)
    received = _all_to_all(chunks, group)  # (n: source = sequence piece, b, h/n, s, d)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, h/n, s, d) head-sharded -> (b, h, s/n, d) sequence-sharded: the inverse of _seq_to_heads."""
    n = dist.get_world_size(group)
    b, hn, s, d = x.shape
    chunks = x.view(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4)  # (n: destination = piece, b, h/n, s/n, d)
    received = _all_to_all(chunks, group)  # (n: source = head group, b, h/n, s/n, d)
    return received.transpose(0, 1).reshape(b, n * hn, s // n, d)


class _SeqToHeads(torch.autograd.Function):
    """All-to-all sequence -> heads; its gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """All-to-all heads -> sequence; its gradient is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _kv_repeats(q_heads: int, kv_heads: int, n: int) -> int:
    """Fewest copies of each kv head so that n ranks can each take whole kv heads for their q heads."""
    group = q_heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % n == 0)


# ----------------------------------------------------------------------------- ring attention
def _scores(q, k, scale):
    """q (b, kv, g, sq, d), k (b, kv, sk, d) -> scores (b, kv, g, sq, sk): GQA without copying k."""
    return torch.einsum("bngqd,bnkd->bngqk", q, k) * scale


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _block_forward(q, k, v, scale, causal):
    """Softmax attention of one query block to one key block: (out, lse), both fp32."""
    s = _scores(q, k, scale)
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bngqk,bnkd->bngqd", torch.exp(s - lse.unsqueeze(-1)), v)
    return out, lse


def _merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results over disjoint keys (in place on out and lse)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q, k, v, dout, lse, delta, scale, causal):
    """Gradients of one block given the final lse and delta = rowsum(dout * out): (dq, dk, dv)."""
    s = _scores(q, k, scale)
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.einsum("bngqk,bngqd->bnkd", p, dout)
    dp = torch.einsum("bngqd,bnkd->bngqk", dout, v)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bngqk,bnkd->bngqd", ds, k) * scale
    dk = torch.einsum("bngqk,bngqd->bnkd", ds, q) * scale
    return dq, dk, dv


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to next, receive from previous."""

    def __init__(self, groups: ContextParallelGroups):
        self.group = groups.ring_group
        ranks, me = groups.ring_ranks, groups.ring_rank
        self.size = len(ranks)
        self.next, self.prev = ranks[(me + 1) % self.size], ranks[(me - 1) % self.size]

    def start(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


_KV_TAG, _DKV_TAG = 11, 12


def _visible(step: int, ring_rank: int, ring: int, half: int):
    """Which (query rows, key columns) of the zigzag block visiting at `step` are unmasked, and causal?"""
    source = (ring_rank - step) % ring
    if step == 0:
        return slice(None), slice(None), True
    if source < ring_rank:  # the block's first chunk precedes both of ours; its second follows both
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # only our second chunk follows the whole block


class _RingAttention(torch.autograd.Function):
    """Causal attention over the zigzag-sharded sequence of a ring of ranks (GQA kept unexpanded)."""

    @staticmethod
    def forward(ctx, q, k, v, groups: ContextParallelGroups):
        ring = _Ring(groups)
        b, hq, sq, d = q.shape
        kv_heads = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        acc = torch.promote_types(q.dtype, torch.float32)  # blocks are computed and merged in fp32 (or fp64)
        q32 = q.to(acc).reshape(b, kv_heads, hq // kv_heads, sq, d)
        block = torch.stack((k.to(acc), v.to(acc)))
        half = sq // 2
        out = lse = None
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, works = ring.start(block, _KV_TAG)
            rows, cols, causal = _visible(step, groups.ring_rank, ring.size, half)
            block_out, block_lse = _block_forward(q32[..., rows, :], block[0][..., cols, :], block[1][..., cols, :],
                                                  scale, causal)
            if out is None:
                out, lse = block_out, block_lse
            else:
                _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if step < ring.size - 1:
                for work in works:
                    work.wait()
                block = incoming
        ctx.groups, ctx.scale = groups, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.view(b, hq, sq, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        ring = _Ring(groups)
        b, hq, sq, d = q.shape
        kv_heads = k.shape[1]
        acc = out.dtype
        q32 = q.to(acc).reshape(b, kv_heads, hq // kv_heads, sq, d)
        dout32 = dout.to(acc).reshape(q32.shape)
        delta = (dout32 * out).sum(-1)
        dq = torch.zeros_like(q32)
        block = torch.stack((k.to(acc), v.to(acc)))
        half = sq // 2
        pending = None  # (gradient arriving from the previous rank, its transfer)
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, works = ring.start(block, _KV_TAG)
            rows, cols, causal = _visible(step, groups.ring_rank, ring.size, half)
            dq_part, dk, dv = _block_backward(q32[..., rows, :], block[0][..., cols, :], block[1][..., cols, :],
                                              dout32[..., rows, :], lse[..., rows], delta[..., rows], scale, causal)
            dq[..., rows, :] += dq_part
            grads = torch.zeros_like(block)  # this block's key/value gradients, accumulated along the ring
            grads[0][..., cols, :] = dk
            grads[1][..., cols, :] = dv
            if pending is not None:  # the earlier ranks' share of this block's gradient
                for work in pending[1]:
                    work.wait()
                grads += pending[0]
            pending = ring.start(grads, _DKV_TAG)  # after the last step the gradient goes home
            if step < ring.size - 1:
                for work in works:
                    work.wait()
                block = incoming
        for work in pending[1]:
            work.wait()
        own = pending[0]
        return dq.view(b, hq, sq, d).to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


# ----------------------------------------------------------------------------- the attention core
class ContextParallelAttention:
    """Replacement for `Attention.core` on sequence shards: Ulysses over the head group, ring over the ring."""

    def __init__(self, groups: ContextParallelGroups):
        self.groups = groups

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0) -> torch.Tensor:
        if past:
            raise RuntimeError("context-parallel attention runs training and evaluation passes, not cached decoding")
        layout, groups = self.groups.layout, self.groups
        if layout.heads > 1:
            repeats = _kv_repeats(q.shape[1], k.shape[1], layout.heads)
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            q, k, v = (_SeqToHeads.apply(t, groups.head_group) for t in (q, k, v))
        if layout.ring > 1:
            out = _RingAttention.apply(q, k, v, groups)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        if layout.heads > 1:
            out = _HeadsToSeq.apply(out, groups.head_group)
        return out


def apply_context_parallel(model: nn.Module, groups: ContextParallelGroups) -> None:
    """Replace every attention core of the model with the context-parallel one."""
    core = ContextParallelAttention(groups)
    for block in model.layers.values():
        block.attention.core = core
