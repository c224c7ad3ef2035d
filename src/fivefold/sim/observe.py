"""What the runtime really sends in a step, recorded by wrapping torch.distributed: the simulator's check.

`recording_traffic()` replaces, for its duration, the torch.distributed entry points the runtime
calls (all-reduce, the flat all-gather and reduce-scatter that tensor parallelism and ZeRO bind at
import, all-to-all, and isend, through which batch_isend_irecv and the hand-written collectives
go) with versions that note each call as (kind, the group's global ranks, bytes) before running
it. Bytes follow the simulator's convention (workload.py): a rank's whole vector for all-reduce,
all-gather (the output) and reduce-scatter (the input), the input for all-to-all, the message for
a send, whose "group" is (sender, receiver).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

Call = tuple[str, tuple[int, ...], int]


def _members(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def recording_traffic(calls: list[Call]) -> Iterator[list[Call]]:
    """Append every collective and send the runtime makes inside the block to `calls`."""
    from fivefold.comm import native
    from fivefold.parallel import collectives, tensor_parallel, zero, zero_pp

    saved: list[tuple[object, str, object]] = []

    def patch(module, name: str, wrapper) -> None:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    all_reduce, all_to_all, isend = dist.all_reduce, dist.all_to_all_single, dist.isend
    gather, scatter = native.all_gather_flat, native.reduce_scatter_flat

    def all_reduce_(tensor, *args, group=None, **kwargs):
        calls.append(("all_reduce", _members(group), _nbytes(tensor)))
        return all_reduce(tensor, *args, group=group, **kwargs)

    def all_to_all_(output, input, *args, group=None, **kwargs):
        calls.append(("all_to_all", _members(group), _nbytes(input)))
        return all_to_all(output, input, *args, group=group, **kwargs)

    def gather_(output, input, *args, group=None, **kwargs):
        calls.append(("all_gather", _members(group), _nbytes(output)))
        return gather(output, input, *args, group=group, **kwargs)

    def scatter_(output, input, *args, group=None, **kwargs):
        calls.append(("reduce_scatter", _members(group), _nbytes(input)))
        return scatter(output, input, *args, group=group, **kwargs)

    inside_isend = []  # under a TorchFunctionMode (the zero-bubble W split) torch re-enters isend for one send

    def isend_(tensor, dst=None, group=None, tag=0, group_dst=None):
        if not inside_isend:
            peer = dst if dst is not None else dist.get_global_rank(group, group_dst)
            calls.append(("send", (dist.get_rank(), peer), _nbytes(tensor)))
        inside_isend.append(True)
        try:
            return isend(tensor, dst, group, tag, group_dst=group_dst)
        finally:
            inside_isend.pop()

    for module in (dist, c10d):
        patch(module, "all_reduce", all_reduce_)
        patch(module, "all_to_all_single", all_to_all_)
        patch(module, "isend", isend_)
    for module in (native, collectives, tensor_parallel, zero, zero_pp):
        if hasattr(module, "all_gather_flat"):
            patch(module, "all_gather_flat", gather_)
        if hasattr(module, "reduce_scatter_flat"):
            patch(module, "reduce_scatter_flat", scatter_)
    try:
        yield calls
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
