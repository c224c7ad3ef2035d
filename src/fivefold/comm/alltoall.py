"""All-to-all by pairwise exchange (the algorithm MPI libraries use for large messages).

Rank i's input holds p equal chunks, chunk j destined for rank j; its output chunk j comes from
rank j. In step k = 1 .. p-1 rank i sends chunk (i+k) mod p to rank i+k and receives output chunk
(i-k) mod p from rank i-k: every rank sends and receives once per step.

Cost: (p-1) (alpha + n/p beta), n the bytes of one rank's input.

`pairwise_all_to_all_v` is the same exchange with uneven chunks (expert-parallel token dispatch).
"""

from __future__ import annotations

import torch

from fivefold.comm.p2p import Ranks, exchange, post


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


def pairwise_all_to_all_v(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], ranks: Ranks) -> torch.Tensor:
    """all_to_all_single with uneven splits along dim 0 (the expert dispatch's exchange).

    Same pairwise order as `pairwise_all_to_all`; both sides know every size in advance (the
    counts are exchanged first), so a step whose message is empty posts nothing for it, and a
    rank with no tokens at all still takes part in every step it is owed data in.
    """
    p, i = ranks.size, ranks.index
    send_at = [0, *torch.tensor(input_splits).cumsum(0).tolist()]
    recv_at = [0, *torch.tensor(output_splits).cumsum(0).tolist()]
    output[recv_at[i] : recv_at[i + 1]] = input[send_at[i] : send_at[i + 1]]
    for k in range(1, p):
        to, source = (i + k) % p, (i - k) % p
        ops = []
        if input_splits[to]:
            ops.append(("send", input[send_at[to] : send_at[to + 1]], to))
        if output_splits[source]:
            ops.append(("recv", output[recv_at[source] : recv_at[source + 1]], source))
        if ops:
            for work in post(ops, ranks):
                work.wait()
    return output
