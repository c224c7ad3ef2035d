"""The messages of the runtime's own collective algorithms, recorded by running them on meta tensors.

Every hand-written collective in comm/ sends through its rank list's transport (comm/p2p.py). A
`RecordingTransport` stands in for torch.distributed: it posts nothing, and writes each send,
receive and wait as an engine operation. Running an algorithm once per rank position on a meta
tensor (shape and dtype, no storage) yields each rank's program: exactly the messages, sizes and
order the runtime would produce, for any number of ranks, in one process and without memory.
The backend's native collectives (gloo, NCCL) are not our code: algorithm "native" models them
as NCCL's ring, i.e. the messages of our ring algorithm (pairwise exchange for all-to-all). An
uneven all-to-all (an expert dispatch under measured routing) is recorded from the runtime's
`pairwise_all_to_all_v` with the bytes of every rank pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fivefold.comm import ALL_REDUCE
from fivefold.comm.alltoall import pairwise_all_to_all, pairwise_all_to_all_v
from fivefold.comm.p2p import Ranks
from fivefold.comm.recursive import recursive_all_gather, recursive_reduce_scatter
from fivefold.comm.ring import ring_all_gather, ring_reduce_scatter
from fivefold.comm.tree import binomial_broadcast
from fivefold.comm.two_level import hierarchical_all_reduce
from fivefold.errors import ConfigError
from fivefold.sim.engine import Op, Recv, Send, StreamKey, Wait

# (collective, algorithm) -> the runtime function taking (flat tensor, Ranks).
ALGORITHMS: dict[tuple[str, str], Callable[..., Any]] = {
    **{("all_reduce", name): fn for name, fn in ALL_REDUCE.items() if fn is not None},
    ("all_reduce", "hierarchical"): hierarchical_all_reduce,  # needs node_size
    ("reduce_scatter", "ring"): ring_reduce_scatter,
    ("reduce_scatter", "recursive"): recursive_reduce_scatter,
    ("all_gather", "ring"): ring_all_gather,
    ("all_gather", "recursive"): recursive_all_gather,
    ("all_to_all", "pairwise"): lambda flat, ranks: pairwise_all_to_all(torch.empty_like(flat), flat, ranks),
    ("broadcast", "binomial"): binomial_broadcast,
}


class _Handle:
    def __init__(self, transport: "RecordingTransport", handle: int):
        self.transport, self.handle = transport, handle

    def wait(self) -> None:
        self.transport.ops.append(Wait((self.handle,)))


class RecordingTransport:
    """A comm/p2p.py transport that records one rank's messages as engine operations."""

    def __init__(self, rank: int, first_handle: int = 0):
        self._rank = rank
        self.ops: list[Op] = []
        self._next = first_handle

    def rank(self) -> int:
        return self._rank

    def post(self, ops: list[tuple[str, torch.Tensor, int]], group: Any) -> list[_Handle]:
        handles = []
        for kind, tensor, peer in ops:
            nbytes = tensor.numel() * tensor.element_size()
            self.ops.append(Send(peer, nbytes, self._next) if kind == "send" else Recv(peer, nbytes, self._next))
            handles.append(_Handle(self, self._next))
            self._next += 1
        return handles


def record(algorithm: Callable[..., Any], members: Sequence[int], numel: int, dtype: torch.dtype = torch.float32,
           first_handle: int = 0, **kwargs: Any) -> dict[int, list[Op]]:
    """Each member's operations when `algorithm(flat, ranks, **kwargs)` runs over `members` on `numel` elements."""
    programs = {}
    for rank in members:
        transport = RecordingTransport(rank, first_handle)
        flat = torch.empty(numel, dtype=dtype, device="meta")
        algorithm(flat, Ranks(tuple(members), None, transport), **kwargs)
        programs[rank] = transport.ops
    return programs


def resolve_algorithm(collective: str, algorithm: str) -> str:
    """The recorded algorithm's name: `native` (the backend's) becomes the one we model it by."""
    if algorithm == "native":
        algorithm = {"all_to_all": "pairwise", "broadcast": "binomial"}.get(collective, "ring")
    if (collective, algorithm) not in ALGORITHMS:
        known = ", ".join(f"{c}/{a}" for c, a in ALGORITHMS)
        raise ConfigError(f"no simulated collective {collective}/{algorithm}; known: {known}")
    return algorithm


def collective_programs(collective: str, algorithm: str, members: Sequence[int], nbytes: int,
                        dtype: torch.dtype = torch.float32, node_size: int = 0,
                        first_handle: int = 0) -> dict[int, list[Op]]:
    """Each member's operations for one collective of `nbytes` per rank (the whole vector; for
    all-to-all, one rank's input), run with the runtime's own algorithm."""
    algorithm = resolve_algorithm(collective, algorithm)
    numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    if collective == "all_to_all":  # equal chunks, one per rank
        numel = max(len(members), numel - numel % len(members))
    kwargs = {"node_size": node_size or len(members)} if algorithm == "hierarchical" else {}
    return record(ALGORITHMS[(collective, algorithm)], members, numel, dtype, first_handle, **kwargs)


def uneven_all_to_all_programs(matrix: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                               first_handle: int = 0) -> dict[int, list[Op]]:
    """Each position's operations in the runtime's uneven pairwise all-to-all (comm/alltoall.py
    `pairwise_all_to_all_v`, the expert dispatch's), matrix[i][j] the bytes position i sends position j."""
    element = torch.empty((), dtype=dtype).element_size()
    members = tuple(range(len(matrix)))
    programs = {}
    for i in members:
        sends = [matrix[i][j] // element for j in members]
        receives = [matrix[j][i] // element for j in members]
        transport = RecordingTransport(i, first_handle)
        output = torch.empty(sum(receives), dtype=dtype, device="meta")
        pairwise_all_to_all_v(output, torch.empty(sum(sends), dtype=dtype, device="meta"), receives, sends,
                              Ranks(members, None, transport))
        programs[i] = transport.ops
    return programs


def as_streams(programs: dict[int, list[Op]], stream: str = "comm") -> dict[StreamKey, list[Op]]:
    return {(rank, stream): ops for rank, ops in programs.items()}
