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

A sliding window (model.sliding_window, Mistral) is exact under every method: Ulysses attends
whole sequences of its heads with the window mask; ring attention masks each (local queries,
visiting block) pair by the tokens' positions, skips a block no local query may see (it still
travels on), and runs masked blocks on the einsum kernel.

Communication per attention layer and micro-batch, per rank, in elements (b batch, s sequence,
h query width, k key/value width): ring 2(3R-2)/R b s k (forward R-1 key/value blocks, backward
R-1 blocks and R gradient blocks), Ulysses 4 (U-1)/U^2 b s (h + k) (q, k, v and the output, each
way), 2D the sum over its two levels; derivation in docs/context_parallel.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fivefold.errors import ConfigError
from fivefold.parallel.collectives import conjugate_function
from fivefold.model.config import ModelConfig
from fivefold.model.llama import attention_core
from fivefold.reliability.activity import phase

CP_METHODS = ("ring", "ulysses", "2d")


# ----------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class ContextParallelLayout:
    """cp = ring x heads ranks. Head-first placement: cp rank p is ring rank p // heads, head-parallel rank
    p % heads (the head group's ranks adjacent); context-first: ring rank p % ring, head rank p // ring.
    The ring is `outer` rounds of an `inner` ring (double-ring attention; inner = ring: one ring); ring
    rank r is inner rank r % inner of outer rank r // inner."""

    ring: int = 1
    heads: int = 1
    inner: int = 0  # 0: the whole ring
    head_first: bool = True

    @property
    def cp(self) -> int:
        return self.ring * self.heads

    @property
    def inner_size(self) -> int:
        return self.inner or self.ring

    @property
    def outer(self) -> int:
        return self.ring // self.inner_size

    @classmethod
    def for_method(cls, method: str, cp: int, cp_heads: int, inner_ring: int = 0,
                   placement: str = "head-first") -> "ContextParallelLayout":
        if method == "ring":
            return cls(ring=cp, heads=1, inner=inner_ring)
        if method == "ulysses":
            return cls(ring=1, heads=cp)
        return cls(ring=cp // cp_heads, heads=cp_heads, inner=inner_ring, head_first=placement == "head-first")

    def coords(self, cp_rank: int) -> tuple[int, int]:
        """(ring rank, head-parallel rank) of a cp rank."""
        if self.head_first:
            return divmod(cp_rank, self.heads)
        head_rank, ring_rank = divmod(cp_rank, self.ring)
        return ring_rank, head_rank

    def cp_rank(self, ring_rank: int, head_rank: int) -> int:
        return ring_rank * self.heads + head_rank if self.head_first else head_rank * self.ring + ring_rank

    def ring_peers(self, ring_rank: int) -> dict[str, tuple[int, int]]:
        """(next, previous) ring ranks on the inner ring and on the outer ring."""
        w, o = self.inner_size, self.outer
        a, b = divmod(ring_rank, w)
        return {"inner": (a * w + (b + 1) % w, a * w + (b - 1) % w),
                "outer": (((a + 1) % o) * w + b, ((a - 1) % o) * w + b)}

    def inner_span(self) -> int:
        """Consecutive cp ranks an inner ring spans (the links its hops cross): W ring ranks, `heads` apart
        when head-first."""
        members = [self.cp_rank(ring_rank, 0) for ring_rank in range(self.inner_size)]
        return max(members) - min(members) + 1

    def source(self, ring_rank: int, round_: int, step: int) -> int:
        """The ring rank whose K/V block `ring_rank` holds at inner step `step` of outer round `round_`: each
        round starts from the block the outer ring brought, then the inner ring passes blocks on."""
        w, o = self.inner_size, self.outer
        a, b = divmod(ring_rank, w)
        return ((a - round_) % o) * w + (b - step) % w

    def shard_positions(self, seq_len: int, cp_rank: int) -> torch.Tensor:
        """Positions (token indices) of the sequence that cp rank `cp_rank` holds, in local order."""
        ring_rank, head_rank = self.coords(cp_rank)
        if self.ring == 1:
            ring_local = torch.arange(seq_len)
        else:
            chunk = seq_len // (2 * self.ring)
            first, second = ring_rank, 2 * self.ring - 1 - ring_rank
            ring_local = torch.cat((torch.arange(first * chunk, (first + 1) * chunk),
                                    torch.arange(second * chunk, (second + 1) * chunk)))
        piece = ring_local.numel() // self.heads
        return ring_local[head_rank * piece:(head_rank + 1) * piece]


def check_context_parallel(config: ModelConfig, cp: int, method: str, cp_heads: int, tp: int, seq_len: int,
                           inner_ring: int = 0) -> None:
    """Raise ConfigError, naming the setting, when the sequence or heads cannot be split this way."""
    if method not in CP_METHODS:
        raise ConfigError(f"context_parallel.method = {method!r} is not one of {', '.join(CP_METHODS)}")
    if cp < 1:
        raise ConfigError(f"context_parallel.degree = {cp}: must be a positive integer")
    if cp > 1 and config.attention == "mla":
        raise ConfigError("context_parallel.degree > 1 with model.attention = mla: the context-parallel attention cores "
                          "expect one head width for keys and values; use context_parallel.degree = 1 with MLA")
    if cp == 1:
        return
    if method == "2d" and (cp_heads < 1 or cp % cp_heads):
        raise ConfigError(f"context_parallel.heads = {cp_heads} must divide context_parallel.degree = {cp} "
                          "(2d attention runs cp_heads-way Ulysses inside cp / cp_heads-way ring)")
    layout = ContextParallelLayout.for_method(method, cp, cp_heads)
    if inner_ring and (layout.ring == 1 or layout.ring % inner_ring):
        raise ConfigError(f"context_parallel.inner_ring = {inner_ring} must divide the ring's {layout.ring} ranks "
                          f"({method} at context_parallel.degree = {cp}): the double ring runs ring / inner_ring rounds "
                          "of an inner ring; use a divisor, or 0 for one ring")
    if layout.ring > 1 and seq_len % (2 * cp):
        raise ConfigError(f"context_parallel.degree = {cp} ({method}) cuts train.seq_len = {seq_len} into 2 x cp = {2 * cp} "
                          "load-balanced chunks: make seq_len a multiple of 2 x cp")
    if seq_len % cp:
        raise ConfigError(f"context_parallel.degree = {cp} must divide train.seq_len = {seq_len}")
    local_heads = config.n_heads // tp
    if layout.heads > 1 and local_heads % layout.heads:
        raise ConfigError(f"{method} attention splits the {local_heads} query heads per tensor-parallel rank "
                          f"(model.n_heads {config.n_heads} / tp {tp}) over {layout.heads} ranks: "
                          "choose a head-parallel degree (context_parallel.degree, or context_parallel.heads for 2d) that divides them")


# ----------------------------------------------------------------------------- groups
@dataclass
class ContextParallelGroups:
    """The process groups one rank's attention uses: its head-parallel group and its ring."""

    layout: ContextParallelLayout
    cp_rank: int
    head_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    ring_ranks: list[int]  # global ranks of this rank's ring, in ring order
    # counting only (plan/operators.py), never in training: every exchange hands back a copy of what it sends (the
    # shapes a neighbour's block has) with no process group, and `posts` counts the exchanges
    loopback: bool = False
    posts: int = 0

    @property
    def ring_rank(self) -> int:
        return self.layout.coords(self.cp_rank)[0]


def build_context_parallel_groups(mesh, layout: ContextParallelLayout) -> ContextParallelGroups:
    """Ask the mesh for the head and ring groups of every cp group (collective: all ranks, same order)."""
    me = dist.get_rank()
    mine: dict = {}
    for row in mesh.rank_table("cp").tolist():
        grid = [[row[layout.cp_rank(i, head)] for head in range(layout.heads)] for i in range(layout.ring)]  # [ring][head]
        rings = [[grid[i][head] for i in range(layout.ring)] for head in range(layout.heads)]
        head_group = mesh.subgroup(grid)
        ring_group = mesh.subgroup(rings)
        if me in row:
            mine.update(cp_rank=row.index(me), head_group=head_group, ring_group=ring_group,
                        ring_ranks=next(ranks for ranks in rings if me in ranks))
    return ContextParallelGroups(layout=layout, **mine)


# ----------------------------------------------------------------------------- Ulysses all-to-all
def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    with phase("context-parallel all-to-all", comm=True):
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


# Each all-to-all's gradient is the inverse all-to-all.
_SeqToHeads = conjugate_function("SeqToHeads", _seq_to_heads, _heads_to_seq)
_HeadsToSeq = conjugate_function("HeadsToSeq", _heads_to_seq, _seq_to_heads)


def _kv_repeats(q_heads: int, kv_heads: int, n: int) -> int:
    """Fewest copies of each kv head so that n ranks can each take whole kv heads for their q heads."""
    group = q_heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % n == 0)


# ----------------------------------------------------------------------------- ring attention
# One block of attention (queries of this rank against one key/value block) returns its output and
# log-sum-exp; its backward takes the *final* output and lse, which makes the per-block gradients
# exact (FlashAttention's backward). On CPU the fused flash kernel does this without materialising
# scores; elsewhere (or if the kernel is missing) our einsum version does, one block at a time.
_FUSED_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _FUSED_FORWARD is not None and _FUSED_BACKWARD is not None


def _grouped(q, kv_heads):
    """(b, h, s, d) -> (b, kv, h/kv, s, d): query heads grouped by the kv head they read (GQA, no copies)."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def _masked_scores(q, k, scale, causal, visible: torch.Tensor | None = None):
    """Scores q k^T * scale, -inf where masked: causally, or outside `visible` (sq, sk) when given."""
    s = torch.einsum("bngqd,bnkd->bngqk", _grouped(q, k.shape[1]), k) * scale
    if visible is not None:
        return s.masked_fill(~visible, float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _zigzag_positions(ring_rank: int, ring: int, chunk: int, device) -> torch.Tensor:
    """Token positions a ring rank holds: chunks ring_rank and 2 ring - 1 - ring_rank of the sequence."""
    second = 2 * ring - 1 - ring_rank
    return torch.cat((torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)))


def _window_visible(source: int, ring_rank: int, ring: int, chunk: int, window: int, device) -> torch.Tensor:
    """(local queries, keys of ring rank `source`) pairs a sliding window of `window` positions leaves visible."""
    q_pos = _zigzag_positions(ring_rank, ring, chunk, device)
    k_pos = _zigzag_positions(source, ring, chunk, device)
    distance = q_pos[:, None] - k_pos[None, :]
    return (distance >= 0) & (distance < window)


def _block_forward(q, k, v, scale, causal, visible: torch.Tensor | None = None):
    """(out, lse) of queries q (b, h, sq, d) against keys/values (b, kv, sk, d), in the accumulation dtype.

    With `visible` (an arbitrary (sq, sk) mask, sliding windows) the einsum kernel runs, and rows that
    see no key get out 0 and lse -inf (they add nothing when merged).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    if visible is None and _fused(q):
        out, lse = _FUSED_FORWARD(q, k, v, 0.0, causal, scale=scale)
        return out.to(acc), lse.to(acc)
    s = _masked_scores(q.to(acc), k.to(acc), scale, causal, visible)
    lse = torch.logsumexp(s, dim=-1)
    weights = torch.exp(s - lse.unsqueeze(-1))
    if visible is not None:
        weights = weights.nan_to_num(0.0)  # -inf - -inf on rows that see nothing here
    out = torch.einsum("bngqk,bnkd->bngqd", weights, v.to(acc))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _block_backward(q, k, v, out, dout, lse, scale, causal, visible: torch.Tensor | None = None):
    """(dq, dk, dv) of one block, given the final out and lse of these query rows (finite: every query
    sees at least itself somewhere)."""
    acc = lse.dtype
    if visible is None and _fused(q):
        dq, dk, dv = _FUSED_BACKWARD(dout.contiguous(), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale)
        return dq.to(acc), dk.to(acc), dv.to(acc)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), _grouped(dout.to(acc), k.shape[1])
    p = torch.exp(_masked_scores(q, k, scale, causal, visible) - _grouped(lse.unsqueeze(-1), k.shape[1]))
    delta = (dout * _grouped(out.to(acc), k.shape[1])).sum(-1, keepdim=True)
    ds = p * (torch.einsum("bngqd,bnkd->bngqk", dout, v) - delta)
    dq = torch.einsum("bngqk,bnkd->bngqd", ds, k) * scale
    dk = torch.einsum("bngqk,bngqd->bnkd", ds, _grouped(q, k.shape[1])) * scale
    dv = torch.einsum("bngqk,bngqd->bnkd", p, dout)
    return dq.flatten(1, 2), dk, dv


def _merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results over disjoint keys (in place on out and lse)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class _Ring:
    """Point-to-point exchange on one of a rank's rings (inner or outer): send to next, receive from previous.
    A ring of one rank exchanges nothing: what is sent is what arrives."""

    def __init__(self, groups: ContextParallelGroups, which: str):
        layout, me = groups.layout, groups.ring_rank
        self.groups, self.group = groups, groups.ring_group
        self.size = layout.inner_size if which == "inner" else layout.outer
        nxt, prev = layout.ring_peers(me)[which]
        self.next, self.prev = groups.ring_ranks[nxt], groups.ring_ranks[prev]

    def start(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        if self.size == 1:
            return send, []
        recv = torch.empty_like(send)
        if self.groups.loopback:
            self.groups.posts += 1
            return recv.copy_(send), []
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    with phase("ring-attention send/receive", comm=True):
        for work in works:
            work.wait()


_KV_TAG, _DKV_TAG, _OUTER_KV_TAG, _OUTER_DKV_TAG = 11, 12, 13, 14


def _visible(source: int, ring_rank: int, half: int):
    """Which (query rows, key columns) of the zigzag block of ring rank `source` are unmasked, and causal?"""
    if source == ring_rank:
        return slice(None), slice(None), True
    if source < ring_rank:  # the block's first chunk precedes both of ours; its second follows both
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # only our second chunk follows the whole block


def ring_attention_node_names() -> frozenset[str]:
    """The names ring attention's autograd function runs under in torch.profiler, forward and backward
    (plan/ring_host.py times its own Python by them)."""
    return frozenset({_RingAttention.__name__, _RingAttention.__name__ + "Backward"})


def _rounds(layout: ContextParallelLayout):
    """(round, step) in visiting order: `outer` rounds of `inner` steps."""
    return [(j, i) for j in range(layout.outer) for i in range(layout.inner_size)]


class _RingAttention(torch.autograd.Function):
    """Causal attention over the zigzag-sharded sequence of a ring of ranks (GQA kept unexpanded).

    The ring runs as `outer` rounds of an `inner` ring (double-ring attention, LoongTrain): in each round the
    K/V blocks circulate the inner ring, one hop per block computed, while the block this rank started the
    round with travels one hop on the outer ring, overlapped with the whole round; the block that arrives
    starts the next round. One ring is the case outer = 1. In backward each block's K/V gradient follows
    its block: around the inner ring within a round, back to the rank that started the round with it,
    then one outer hop per round, arriving home after the last.

    With a sliding window (window > 0) each (queries, visiting block) pair gets the mask of its
    token positions, a block no query of this rank may see is skipped (it still travels on), and
    the masked blocks run on the einsum kernel (the fused one takes only a causal flag).
    """

    @staticmethod
    def forward(ctx, q, k, v, groups: ContextParallelGroups, window: int = 0):
        layout, me = groups.layout, groups.ring_rank
        inner, outer = _Ring(groups, "inner"), _Ring(groups, "outer")
        scale = 1.0 / math.sqrt(q.shape[-1])
        half = q.shape[2] // 2
        block = torch.stack((k, v))
        out = lse = None
        for round_, step in _rounds(layout):
            if step == 0 and round_ < outer.size - 1:  # this round's first block moves on to the next node
                arriving, outer_works = outer.start(block, _OUTER_KV_TAG)
            if step < inner.size - 1:
                incoming, works = inner.start(block, _KV_TAG)
            source = layout.source(me, round_, step)
            if window:
                visible = _window_visible(source, me, layout.ring, half, window, q.device)
                if visible.any():
                    block_out, block_lse = _block_forward(q, block[0], block[1], scale, False, visible)
                    if out is None:
                        out, lse = block_out, block_lse
                    else:
                        _merge(out, lse, block_out, block_lse)
            else:
                rows, cols, causal = _visible(source, me, half)
                block_out, block_lse = _block_forward(q[..., rows, :], block[0][..., cols, :], block[1][..., cols, :],
                                                      scale, causal)
                if out is None:
                    out, lse = block_out, block_lse
                else:
                    _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if step < inner.size - 1:
                _wait(works)
                block = incoming
            elif round_ < outer.size - 1:
                _wait(outer_works)
                block = arriving
        ctx.groups, ctx.scale, ctx.window = groups, scale, window
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        layout, me = groups.layout, groups.ring_rank
        inner, outer = _Ring(groups, "inner"), _Ring(groups, "outer")
        half = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        block = torch.stack((k, v))
        pending = outer_pending = None  # (gradient arriving from the previous rank, its transfer)
        for round_, step in _rounds(layout):
            if step == 0 and round_ < outer.size - 1:
                arriving, outer_works = outer.start(block, _OUTER_KV_TAG)
            if step < inner.size - 1:
                incoming, works = inner.start(block, _KV_TAG)
            source = layout.source(me, round_, step)
            grads = torch.zeros(block.shape, dtype=lse.dtype, device=q.device)  # this block's, accumulated on the way
            if ctx.window:
                visible = _window_visible(source, me, layout.ring, half, ctx.window, q.device)
                if visible.any():
                    dq_part, grads[0], grads[1] = _block_backward(q, block[0], block[1], out, dout, lse, scale, False,
                                                                  visible)
                    dq += dq_part
            else:
                rows, cols, causal = _visible(source, me, half)
                dq_part, dk, dv = _block_backward(q[..., rows, :], block[0][..., cols, :], block[1][..., cols, :],
                                                  out[..., rows, :], dout[..., rows, :], lse[..., rows], scale, causal)
                dq[..., rows, :] += dq_part
                grads[0][..., cols, :] = dk
                grads[1][..., cols, :] = dv
            if pending is not None:  # the inner ring's earlier ranks' share of this block's gradient
                _wait(pending[1])
                grads += pending[0]
            pending = inner.start(grads, _DKV_TAG)  # after the round's last step: back to the round's first holder
            if step < inner.size - 1:
                _wait(works)
                block = incoming
                continue
            _wait(pending[1])
            round_grads, pending = pending[0], None  # this round's gradient of the block this rank started it with
            if outer_pending is not None:  # the earlier rounds' share, from the previous node
                _wait(outer_pending[1])
                round_grads = round_grads + outer_pending[0]
            outer_pending = outer.start(round_grads, _OUTER_DKV_TAG)  # after the last round: home
            if round_ < outer.size - 1:
                _wait(outer_works)
                block = arriving
        _wait(outer_pending[1])
        own = outer_pending[0]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


# ----------------------------------------------------------------------------- the attention core
class ContextParallelAttention:
    """Replacement for `Attention.core` on sequence shards: Ulysses over the head group, ring over the ring."""

    def __init__(self, groups: ContextParallelGroups):
        self.groups = groups

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0, window: int = 0) -> torch.Tensor:
        if past:
            raise ConfigError("context-parallel attention runs training and evaluation passes, not cached decoding: "
                              "generate in one process (fivefold generate --checkpoint)")
        layout, groups = self.groups.layout, self.groups
        if layout.heads > 1:
            repeats = _kv_repeats(q.shape[1], k.shape[1], layout.heads)
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            q, k, v = (_SeqToHeads.apply(t, groups.head_group) for t in (q, k, v))
        if layout.ring > 1:
            out = _RingAttention.apply(q, k, v, groups, window)
        else:  # after the all-to-all this rank holds its heads over the whole sequence, in order
            out = attention_core(q, k, v, 0, window)
        if layout.heads > 1:
            out = _HeadsToSeq.apply(out, groups.head_group)
        return out


def apply_context_parallel(model: nn.Module, groups: ContextParallelGroups) -> None:
    """Replace every attention core of the model with the context-parallel one."""
    core = ContextParallelAttention(groups)
    for block in model.layers.values():
        block.attention.core = core
