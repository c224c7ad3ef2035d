"""What the runtime really sends in a step, recorded by wrapping torch.distributed: the simulator's check.

`recording_traffic()` replaces, for its duration, the torch.distributed entry points the runtime
calls (all-reduce, the flat all-gather and reduce-scatter that tensor parallelism and ZeRO bind at
import, the list all-gather, all-to-all, and isend, through which batch_isend_irecv and the hand-written collectives
go) with versions that note each call as (kind, the group's global ranks, bytes) before running
it. Bytes follow the simulator's convention (workload.py): a rank's whole vector for all-reduce,
all-gather (the output) and reduce-scatter (the input), the input for all-to-all, the message for
a send, whose "group" is (sender, receiver).
"""

from __future__ import annotations

import contextlib
import threading
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
    """Append every collective and send the runtime makes inside the block to `calls`.

    A call made while another is being recorded is not recorded again: under a TorchFunctionMode (the
    zero-bubble W split) torch re-enters the entry point for one call, and all_gather_object (the
    metrics of a logged step: bookkeeping, not the step) calls all_gather itself. "While" is per thread: the
    data-parallel communication threads (one per DDP instance: the dense weights' and the routed experts') call
    at the same time as each other and as the training thread, and each of their calls is the runtime's own."""
    from fivefold.comm import native
    from fivefold.parallel import collectives, tensor_parallel, zero, zero_pp
    from fivefold.parallel.pipeline import executor

    saved: list[tuple[object, str, object]] = []
    local = threading.local()  # local.inside: this thread is inside a recorded call

    def patch(module, name: str, wrapper) -> None:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    def recorded(kind: str, original, describe):
        """`original` noting (kind, group ranks, bytes) first, unless inside another recorded call."""
        def wrapper(*args, **kwargs):
            depth = getattr(local, "inside", 0)
            if not depth and describe is not None:
                calls.append((kind, *describe(*args, **kwargs)))
            local.inside = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = depth
        return wrapper

    def whole(tensor, *args, group=None, **kwargs):  # all-reduce: the vector
        return _members(group), _nbytes(tensor)

    def second(output, input, *args, group=None, **kwargs):  # all-to-all, reduce-scatter: the input
        return _members(group), _nbytes(input)

    def first(output, input, *args, group=None, **kwargs):  # the flat all-gather: the output
        return _members(group), _nbytes(output)

    def listed(outputs, input, *args, group=None, **kwargs):  # the list all-gather (expert tensor parallelism's tables)
        return _members(group), sum(_nbytes(t) for t in outputs)

    def message(tensor, dst=None, group=None, tag=0, group_dst=None):
        peer = dst if dst is not None else dist.get_global_rank(group, group_dst)
        return (dist.get_rank(), peer), _nbytes(tensor)

    wrappers = {"all_reduce": recorded("all_reduce", dist.all_reduce, whole),
                "all_to_all_single": recorded("all_to_all", dist.all_to_all_single, second),
                "isend": recorded("send", dist.isend, message),
                "all_gather": recorded("all_gather", dist.all_gather, listed),
                "all_gather_object": recorded("", dist.all_gather_object, None)}
    gather = recorded("all_gather", native.all_gather_flat, first)
    scatter = recorded("reduce_scatter", native.reduce_scatter_flat, second)
    for module in (dist, c10d):
        for name, wrapper in wrappers.items():
            patch(module, name, wrapper)
    for module in (native, collectives, tensor_parallel, zero, zero_pp, executor):
        if hasattr(module, "all_gather_flat"):
            patch(module, "all_gather_flat", gather)
        if hasattr(module, "reduce_scatter_flat"):
            patch(module, "reduce_scatter_flat", scatter)
    try:
        yield calls
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
