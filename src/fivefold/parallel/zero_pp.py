"""ZeRO++ (Wang et al. 2023): less cross-node traffic for ZeRO stage 3, three switches each on its own.

    qwZ  quantised weight communication: each rank quantises its parameter shard to int8 in blocks
         of `block` values (one fp32 scale per block, max |x| / 127) before the all-gather, and every
         rank dequantises what it receives. Bytes of a gather: 1 + 4/block per element instead of
         2 (bf16) or 4 (fp32).
    hpZ  hierarchical partitioning: after a block's forward gather, each rank keeps a secondary
         shard, 1/h of the gathered (already dequantised) weights, sharded over h ranks of its own
         node. The block's backward gather then runs over those h ranks only: no cross-node bytes.
         Memory: + 1/h of the blocks' weights per rank, held from a block's forward to its backward.
    qgZ  quantised gradient communication: the reduce-scatter becomes two all-to-alls of block-
         quantised values (int8, or int4 as in the paper, packed two per byte). With K nodes of L
         ranks, rank (a, l) first sends to each node peer l' the K chunks that ranks (., l') own,
         sums what it receives (dequantised, in rank order), requantises, and sends chunk a' to rank
         (a', l) across the nodes; the sum of those is its shard. Cross-node bytes per rank:
         (K - 1)/K x n/L x (bits/8 + 4/block), against (N - 1)/N x n x 4 for an fp32 reduce-scatter.

Nodes are `gradient_comm.node_size` consecutive global ranks (0: torchrun's LOCAL_WORLD_SIZE), so
one machine can stand in for several nodes, which is how the tests count the bytes each group
carries (`ZeroTraffic`). qwZ and qgZ are lossy (bounded, see docs/zero_pp.md); hpZ alone gathers
the very same values as plain ZeRO-3 and is exact.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivefold.errors import ConfigError
from fivefold.parallel.collectives import all_gather_flat

GRADIENT_BITS = (0, 4, 8)


@dataclass(frozen=True)
class ZeroPPOptions:
    """Which ZeRO++ methods are on (data_parallel.quantized_weights / hpz_partition / quantized_gradients)."""

    quantized_weights: bool = False
    hpz_partition: int = 1  # h: ranks of one node the secondary shard is spread over; 1 = off
    gradient_bits: int = 0  # 0 = off, 8 or 4
    block: int = 256
    node_size: int = 0  # ranks per node, resolved (0: the whole world is one node)

    @property
    def active(self) -> bool:
        return self.quantized_weights or self.hpz_partition > 1 or self.gradient_bits > 0


# ------------------------------------------------------------------------------ block quantisation
def quantize_rows(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of x [P, c] in blocks of `block` values: (codes [P, c' x bits/8] uint8, scales [P, c'/block]).

    c' is c rounded up to a multiple of block (zero padding). int8 codes are stored as their bytes;
    int4 codes (-7 .. 7) are offset by 8 and packed two per byte.
    """
    rows, cols = x.shape
    padded = -(-cols // block) * block
    x = F.pad(x.float(), (0, padded - cols)).view(rows, padded // block, block)
    top = 127 if bits == 8 else 7
    scales = x.abs().amax(dim=2) / top
    codes = torch.round(x / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp_(-top, top)
    codes = codes.view(rows, padded)
    if bits == 8:
        return codes.to(torch.int8).view(torch.uint8), scales
    nibbles = (codes + 8).to(torch.uint8).view(rows, padded // 2, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, cols: int) -> torch.Tensor:
    """The fp32 rows [P, cols] that `quantize_rows` encoded."""
    rows = codes.shape[0]
    if bits == 8:
        values = codes.view(torch.int8).float()
    else:
        values = torch.stack([(codes & 15), (codes >> 4)], dim=-1).view(rows, -1).float() - 8
    padded = values.shape[1]
    return (values.view(rows, padded // block, block) * scales[..., None]).view(rows, padded)[:, :cols]


# ------------------------------------------------------------------------------------- the groups
def node_rows(shard_rows: list[list[int]], node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra, inter) rows of global ranks for qgZ: each shard group's members split by node (node = rank
    // node_size), and, for each place l within a node, the l-th member of every node.

    Refuses a shard group whose nodes hold different numbers of its ranks (the all-to-alls need a grid).
    """
    intra, inter = [], []
    for row in shard_rows:
        by_node: dict[int, list[int]] = defaultdict(list)
        for rank in sorted(row):
            by_node[rank // node_size].append(rank)
        nodes = list(by_node.values())
        if len({len(n) for n in nodes}) != 1:
            raise ConfigError(f"data_parallel.quantized_gradients: the ZeRO shard group {sorted(row)} has "
                              f"{[len(n) for n in nodes]} ranks on its nodes of gradient_comm.node_size = {node_size}; "
                              "qgZ needs the same number on every node: change node_size or the data-parallel degrees")
        intra += nodes
        inter += [list(column) for column in zip(*nodes)]
    return intra, inter


def hpz_rows(shard_rows: list[list[int]], partition: int, node_size: int) -> list[list[int]]:
    """The secondary partition groups: `partition` consecutive members of each shard group, on one node."""
    rows = []
    for row in shard_rows:
        members = sorted(row)
        if len(members) % partition:
            raise ConfigError(f"data_parallel.hpz_partition = {partition} must divide the ZeRO shard degree "
                              f"{len(members)} (data_parallel.shard x context_parallel.degree)")
        for start in range(0, len(members), partition):
            part = members[start : start + partition]
            if len({rank // node_size for rank in part}) > 1:
                raise ConfigError(f"data_parallel.hpz_partition = {partition}: ranks {part} of one secondary partition "
                                  f"lie on different nodes of gradient_comm.node_size = {node_size}; use a partition "
                                  "that divides the ranks per node (usually the node size itself)")
            rows.append(part)
    return rows


@dataclass
class ZeroPPGroups:
    """This rank's process groups for ZeRO++ (None where a group would have one rank)."""

    options: ZeroPPOptions
    spans_nodes: Callable[[dist.ProcessGroup | None], bool]
    hpz: dist.ProcessGroup | None = None
    intra: dist.ProcessGroup | None = None
    inter: dist.ProcessGroup | None = None


def build_zero_pp_groups(options: ZeroPPOptions, shard_rows: list[list[int]],
                         subgroup: Callable[[list[list[int]]], dist.ProcessGroup | None]) -> ZeroPPGroups:
    """Create the groups ZeRO++ needs (collective: every rank passes the same rows)."""
    node = options.node_size or dist.get_world_size()

    def spans_nodes(group: dist.ProcessGroup | None) -> bool:
        return group is not None and len({r // node for r in dist.get_process_group_ranks(group)}) > 1

    groups = ZeroPPGroups(options, spans_nodes)
    if options.hpz_partition > 1:
        groups.hpz = subgroup(hpz_rows(shard_rows, options.hpz_partition, node))
    if options.gradient_bits:
        intra, inter = node_rows(shard_rows, node)
        groups.intra, groups.inter = subgroup(intra), subgroup(inter)
    return groups


# ------------------------------------------------------------------------------ the bytes counted
@dataclass
class ZeroTraffic:
    """Bytes this rank sent in ZeRO's collectives, by phase and by whether the group spans nodes.

    Each collective counts the volume of its ring form, what every rank of a p-rank group sends:
    (p - 1)/p of the gathered or scattered vector, 2 (p - 1)/p of an all-reduced one.
    """

    sent: dict[tuple[str, bool], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, phase: str, cross_node: bool, group: dist.ProcessGroup | None, vector_bytes: int,
            all_reduce: bool = False) -> None:
        if group is None:
            return
        p = dist.get_world_size(group)
        self.sent[(phase, cross_node)] += (2 if all_reduce else 1) * (p - 1) * vector_bytes // p

    def take(self) -> dict[tuple[str, bool], int]:
        """The counts so far, and start again."""
        out, self.sent = dict(self.sent), defaultdict(int)
        return out

    @staticmethod
    def cross_node(counts: dict[tuple[str, bool], int]) -> dict[str, int]:
        """Bytes per phase in groups that span nodes."""
        return {phase: n for (phase, cross), n in counts.items() if cross}


# ---------------------------------------------------------------------------- the communication
class Pending:
    """Works in flight and what to do once they are done (dequantise, second stage); waits once."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None):
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def quantized_all_gather(full: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup, block: int,
                         traffic: ZeroTraffic, phase: str, cross_node: bool) -> Pending:
    """qwZ: all-gather int8 codes and scales of `local` into `full` (dequantised on wait)."""
    p = dist.get_world_size(group)
    codes, scales = quantize_rows(local.view(1, -1), 8, block)
    all_codes = torch.empty(p * codes.numel(), dtype=torch.uint8, device=local.device)
    all_scales = torch.empty(p * scales.numel(), dtype=torch.float32, device=local.device)
    works = [all_gather_flat(all_codes, codes.view(-1), group=group, async_op=True),
             all_gather_flat(all_scales, scales.view(-1), group=group, async_op=True)]
    traffic.add(phase, cross_node, group, all_codes.numel() + 4 * all_scales.numel())

    def finish() -> None:
        values = dequantize_rows(all_codes.view(p, -1), all_scales.view(p, -1), 8, block, local.numel())
        full.copy_(values.reshape(-1))

    return Pending(works, finish)


def _exchange(send: torch.Tensor, bits: int, block: int, group: dist.ProcessGroup, traffic: ZeroTraffic, phase: str,
              cross_node: bool) -> Callable[[], torch.Tensor]:
    """Quantise the rows of send [p, c] (row j for group rank j), all-to-all them; returns `receive` giving the
    rows received [p, c] in fp32 once the exchange is done (it waits)."""
    codes, scales = quantize_rows(send, bits, block)
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    works = [dist.all_to_all_single(got_codes, codes, group=group, async_op=True),
             dist.all_to_all_single(got_scales, scales, group=group, async_op=True)]
    traffic.add(phase, cross_node, group, codes.numel() + 4 * scales.numel())

    def receive() -> torch.Tensor:
        for work in works:
            work.wait()
        return dequantize_rows(got_codes, got_scales, bits, block, send.shape[1])

    return receive


def quantized_reduce_scatter(out: torch.Tensor, full: torch.Tensor, groups: ZeroPPGroups, traffic: ZeroTraffic,
                             phase: str = "reduce-scatter") -> Pending:
    """qgZ: this rank's shard `out` of the sum of `full` over the shard group, by two quantised all-to-alls
    (within the node, then across nodes); the first is in flight when this returns, the rest runs on wait."""
    bits, block = groups.options.gradient_bits, groups.options.block
    intra, inter = groups.intra, groups.inter
    nodes = dist.get_world_size(inter) if inter is not None else 1
    per_node = dist.get_world_size(intra) if intra is not None else 1
    shard = out.numel()
    # chunk (a, l) of the flat vector belongs to the rank at place l of node a; as [L, K, shard]: for node peer l
    # the K chunks it will forward across the nodes, in node order
    chunks = full.view(nodes, per_node, shard).transpose(0, 1).reshape(per_node, nodes * shard)
    if intra is None:
        first = lambda: chunks.float()  # noqa: E731 (one rank per node: nothing to exchange within it)
    else:
        first = _exchange(chunks, bits, block, intra, traffic, phase, groups.spans_nodes(intra))

    def finish() -> None:
        partial = first().sum(dim=0) if intra is not None else first()[0]  # this node's sums of my K chunks
        if inter is None:
            out.copy_(partial)
            return
        second = _exchange(partial.view(nodes, shard), bits, block, inter, traffic, phase, groups.spans_nodes(inter))
        out.copy_(second().sum(dim=0))

    return Pending([], finish)
