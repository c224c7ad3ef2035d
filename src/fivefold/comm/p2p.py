"""Point-to-point building blocks of the hand-written collectives: a rank list, send, receive, exchange.

Every algorithm in comm/ runs over an ordered list of global ranks (`Ranks`), so the same code
serves the whole world, one node of a hierarchical all-reduce, or one row of a torus, without
creating process groups: messages go by global rank through `torch.distributed` isend/irecv on
the default group, or on a group that holds all the members (data parallelism passes its own,
so its gradient traffic never shares a channel with the main thread's). An exchange posts its send and its receive together (batch_isend_irecv), so
two ranks trading data never wait on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """An ordered list of global ranks taking part in a collective, and this process's place in it."""

    members: tuple[int, ...]
    group: dist.ProcessGroup | None = None  # None: the default group

    @classmethod
    def world(cls) -> "Ranks":
        return cls(tuple(range(dist.get_world_size())))

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> "Ranks":
        """The ranks of a process group, in its order, messages sent on it."""
        return cls(tuple(dist.get_process_group_ranks(group)), group)

    def subset(self, members: tuple[int, ...]) -> "Ranks":
        """Some of these ranks, on the same group."""
        return Ranks(tuple(members), self.group)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        """This process's position in the list."""
        return self.members.index(dist.get_rank())

    def global_rank(self, index: int) -> int:
        return self.members[index % self.size]


def send(tensor: torch.Tensor, ranks: Ranks, to: int) -> dist.Work:
    return dist.isend(tensor.contiguous(), ranks.global_rank(to), group=ranks.group)


def recv(tensor: torch.Tensor, ranks: Ranks, source: int) -> None:
    dist.recv(tensor, ranks.global_rank(source), group=ranks.group)


def exchange(outgoing: torch.Tensor, to: int, incoming: torch.Tensor, source: int, ranks: Ranks) -> None:
    """Send `outgoing` to position `to` while receiving `incoming` from position `source`; wait for both."""
    ops = [dist.P2POp(dist.isend, outgoing.contiguous(), ranks.global_rank(to), ranks.group),
           dist.P2POp(dist.irecv, incoming, ranks.global_rank(source), ranks.group)]
    for work in dist.batch_isend_irecv(ops):
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
