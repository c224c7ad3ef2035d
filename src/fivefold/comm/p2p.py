"""Point-to-point building blocks of the hand-written collectives: a rank list, send, receive, exchange.

Every algorithm in comm/ runs over an ordered list of global ranks (`Ranks`), so the same code
serves the whole world, one node of a hierarchical all-reduce, or one row of a torus, without
creating process groups: messages go by global rank through `torch.distributed` isend/irecv on
the default group, or on a group that holds all the members (data parallelism passes its own,
so its gradient traffic never shares a channel with the main thread's). An exchange posts its send and its receive together (batch_isend_irecv), so
two ranks trading data never wait on each other.

Every message goes through the rank list's `Transport`: `torch.distributed` unless told otherwise.
The simulator (sim/trace.py) passes a recording transport instead and runs the same algorithm
code for each rank on meta tensors, so the messages it simulates are exactly those the runtime
sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class Handle(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    """Where a rank list's messages go: this process's rank, and posting sends and receives by global rank."""

    def rank(self) -> int: ...

    def post(self, ops: list[tuple[str, torch.Tensor, int]], group: dist.ProcessGroup | None) -> list[Handle]:
        """Post ("send" | "recv", tensor, global peer) operations together; one handle each."""
        ...


class TorchDistributed:
    """The runtime's transport: torch.distributed isend/irecv (batched when posted together)."""

    def rank(self) -> int:
        return dist.get_rank()

    def post(self, ops: list[tuple[str, torch.Tensor, int]], group: dist.ProcessGroup | None) -> list[Handle]:
        if len(ops) == 1:
            kind, tensor, peer = ops[0]
            return [(dist.isend if kind == "send" else dist.irecv)(tensor, peer, group=group)]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group)
                                       for kind, tensor, peer in ops])


TORCH_DISTRIBUTED = TorchDistributed()


@dataclass(frozen=True)
class Ranks:
    """An ordered list of global ranks taking part in a collective, and this process's place in it."""

    members: tuple[int, ...]
    group: dist.ProcessGroup | None = None  # None: the default group
    transport: Transport = TORCH_DISTRIBUTED

    @classmethod
    def world(cls) -> "Ranks":
        return cls(tuple(range(dist.get_world_size())))

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> "Ranks":
        """The ranks of a process group, in its order, messages sent on it."""
        return cls(tuple(dist.get_process_group_ranks(group)), group)

    def subset(self, members: tuple[int, ...]) -> "Ranks":
        """Some of these ranks, on the same group."""
        return Ranks(tuple(members), self.group, self.transport)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        """This process's position in the list."""
        return self.members.index(self.transport.rank())

    def global_rank(self, index: int) -> int:
        return self.members[index % self.size]


def post(ops: list[tuple[str, torch.Tensor, int]], ranks: Ranks) -> list[Handle]:
    """Post ("send" | "recv", tensor, position) operations together; returns their handles."""
    return ranks.transport.post([(kind, tensor.contiguous() if kind == "send" else tensor, ranks.global_rank(at))
                                 for kind, tensor, at in ops], ranks.group)


def send(tensor: torch.Tensor, ranks: Ranks, to: int) -> Handle:
    return post([("send", tensor, to)], ranks)[0]


def recv(tensor: torch.Tensor, ranks: Ranks, source: int) -> None:
    post([("recv", tensor, source)], ranks)[0].wait()


def exchange(outgoing: torch.Tensor, to: int, incoming: torch.Tensor, source: int, ranks: Ranks) -> None:
    """Send `outgoing` to position `to` while receiving `incoming` from position `source`; wait for both."""
    for work in post([("send", outgoing, to), ("recv", incoming, source)], ranks):
        work.wait()


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of `parts` nearly equal contiguous pieces (the first numel % parts one longer)."""
    base, extra = divmod(numel, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
