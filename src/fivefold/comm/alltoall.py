"""All-to-all by pairwise exchange (the algorithm MPI libraries use for large messages).

Rank i's input holds p equal chunks, chunk j destined for rank j; its output chunk j comes from
rank j. In step k = 1 .. p-1 rank i sends chunk (i+k) mod p to rank i+k and receives output chunk
(i-k) mod p from rank i-k: every rank sends and receives once per step.

Cost: (p-1) (alpha + n/p beta), n the bytes of one rank's input.
"""

from __future__ import annotations

import torch

from fivefold.comm.p2p import Ranks, exchange


def pairwise_all_to_all(output: torch.Tensor, input: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """torch.distributed.all_to_all_single semantics on 1-D tensors of equal chunks."""
    p, i = ranks.size, ranks.index
    if input.numel() % p or output.numel() != input.numel():
        raise ValueError(f"all-to-all needs input and output of the same size, a multiple of {p}")
    size = input.numel() // p
    out, inp = output.view(p, size), input.reshape(p, size)
    out[i] = inp[i]
    for k in range(1, p):
        exchange(inp[(i + k) % p], i + k, out[(i - k) % p], i - k, ranks)
    return output
