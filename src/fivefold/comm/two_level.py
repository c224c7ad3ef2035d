"""Two-level all-reduce: hierarchical (intra-node / inter-node) and 2D torus.

Ranks form a grid of `inner` consecutive ranks (a node, or a torus row) by p / inner. Three phases:

    1. reduce-scatter inside each row (ring): row position l holds chunk l of the row's sum
    2. all-reduce chunk l across the rows, among the ranks at position l (one per row)
    3. all-gather inside each row (ring)

    hierarchical   rows are nodes of `node_size` ranks (`gradient_comm.node_size` on one machine,
                   LOCAL_WORLD_SIZE under torchrun); the inter-node phase uses a chosen
                   algorithm (Rabenseifner by default), and only n / node_size bytes per rank
                   cross the slow links (Jia et al. 2018; NCCL's and Horovod's hierarchical mode).
    torus          rows and columns of a near-square grid, rings in both dimensions (Mikami et
                   al. 2018, "2D-Torus all-reduce"): 2 (X-1) + 2 (Y-1) latency terms instead of
                   2 (p-1) for one ring.

Cost with rows of L ranks, R = p / L rows, intra-row link (alpha_1, beta_1), across rows (alpha_2, beta_2):
    2 (L-1) alpha_1 + 2 (L-1)/L n beta_1  +  all-reduce of n/L bytes over R ranks on (alpha_2, beta_2)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from fivefold.comm.p2p import Ranks
from fivefold.comm.recursive import rabenseifner_all_reduce
from fivefold.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from fivefold.errors import ConfigError


def _grid(ranks: Ranks, inner: int) -> tuple[Ranks, Ranks]:
    """(this rank's row, this rank's column) of the grid with rows of `inner` consecutive ranks."""
    p, i = ranks.size, ranks.index
    if inner < 1 or p % inner:
        raise ConfigError(f"a node of {inner} ranks (gradient_comm.node_size) must divide the {p} ranks: use a divisor")
    row, position = divmod(i, inner)
    row_ranks = ranks.subset(ranks.members[row * inner:(row + 1) * inner])
    column_ranks = ranks.subset(tuple(ranks.members[r * inner + position] for r in range(p // inner)))
    return row_ranks, column_ranks


def two_level_all_reduce(flat: torch.Tensor, ranks: Ranks, inner: int,
                         across: Callable[[torch.Tensor, Ranks], torch.Tensor] = ring_all_reduce) -> torch.Tensor:
    row, column = _grid(ranks, inner)
    chunk = ring_reduce_scatter(flat, row) if row.size > 1 else flat
    if column.size > 1:
        across(chunk, column)
    if row.size > 1:
        ring_all_gather(flat, row)
    return flat


def hierarchical_all_reduce(flat: torch.Tensor, ranks: Ranks, node_size: int,
                            across: Callable[[torch.Tensor, Ranks], torch.Tensor] | None = None) -> torch.Tensor:
    return two_level_all_reduce(flat, ranks, node_size, across or rabenseifner_all_reduce)


def torus_shape(p: int) -> tuple[int, int]:
    """(row length, rows) of the most nearly square grid: rows = the largest divisor of p up to sqrt(p)."""
    rows = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
    return p // rows, rows


def torus_all_reduce(flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    row_length, _ = torus_shape(ranks.size)
    return two_level_all_reduce(flat, ranks, row_length, ring_all_reduce)

