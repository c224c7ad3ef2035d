"""Data parallelism: bucketed gradient all-reduce overlapped with backward (Li et al. 2020, "PyTorch Distributed").

Parameters are grouped into flat buckets of about `bucket_cap_mb`, in reverse registration
order (the order backward produces their gradients). A post-accumulate-grad hook copies each
gradient into its bucket as soon as autograd has finished accumulating it; when a bucket is
full, its all-reduce is launched asynchronously, so communication of late layers overlaps the
backward of early ones. Buckets are launched strictly in order, so every rank issues the same
sequence of collectives. The optimizer step waits only in `finish_gradient_sync`.

Reduction is a SUM: the trainer divides each rank's loss by the token count of the *global*
batch, so summing gives exactly the single-process gradient even when ranks see different
numbers of tokens (token-weighted averaging). On accumulation micro-steps, `no_sync()` skips
communication; the last micro-step reduces the accumulated gradient once.

Per step each rank sends and receives about 2(p-1)/p x (gradient bytes in reduce_dtype) with a
ring all-reduce; `reduce_dtype=bf16` halves that for fp32 gradients at the cost of precision.

How a bucket is summed is a reducer (comm/reducers.py): the backend's all-reduce by default, a
hand-written algorithm (`gradient_comm.allreduce_algorithm`), or a compression codec
(`gradient_comm.compression`, comm/compression.py). Reducers other than the backend's run on one
communication thread, buckets in launch order, so they overlap backward the same way.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Callable
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fivefold.comm.reducers import CommThread, NativeReducer, Reducer
from fivefold.errors import ConfigError
from fivefold.parallel.checkpoint_layout import PieceRanks
from fivefold.parallel.gradient_sync import (
    GradientSync,
    GradNorm,
    clip_,
    clip_whole_,
    load_whole_pieces,
    pieces_of_state,
    sum_of_squares,
    whole_state,
)
from fivefold.reliability.activity import phase


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: int = 0
    captured: set[int] = field(default_factory=set)  # indices whose gradient a hook copied in this pass
    work: dist.Work | concurrent.futures.Future | None = field(default=None, repr=False)

    def view(self, index: int) -> torch.Tensor:
        param = self.params[index]
        return self.buffer[self.offsets[index] : self.offsets[index] + param.numel()].view_as(param)


def make_buckets(params: list[nn.Parameter], bucket_cap_mb: float, dtype: torch.dtype | None) -> list[Bucket]:
    """Flat buckets of about bucket_cap_mb, filled in reverse parameter order."""
    cap = max(1, int(bucket_cap_mb * 2**20))
    buckets, current, size = [], [], 0
    for param in reversed(params):
        current.append(param)
        size += param.numel() * (dtype or param.dtype).itemsize
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    out = []
    for group in buckets:
        offsets, total = [], 0
        for param in group:
            offsets.append(total)
            total += param.numel()
        buffer = torch.zeros(total, dtype=dtype or group[0].dtype, device=group[0].device)
        out.append(Bucket(group, offsets, buffer))
    return out


@torch.no_grad()
def broadcast_module(model: nn.Module, group: dist.ProcessGroup, params: list[nn.Parameter] | None = None) -> None:
    """Copy the parameters (or just `params`) and buffers of the group's first rank to every rank of the group."""
    src = dist.get_global_rank(group, 0)
    for tensor in [*(model.parameters() if params is None else params), *model.buffers()]:
        dist.broadcast(tensor, src=src, group=group)


class SkipOnAccumulation:
    """Hooks that skip communication on accumulation micro-steps (inside `no_sync()`)."""

    reduces_every_micro_step = False  # ZeRO-2/3 reduce-scatter each micro-step to keep only shards
    _sync = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation micro-steps: no communication, unless the scheme must reduce every micro-step."""
        self._sync = self.reduces_every_micro_step
        try:
            yield
        finally:
            self._sync = True


@dataclass
class OverlapMeter:
    """How much gradient communication computation hid: busy = seconds the communication thread
    spent reducing, exposed = seconds the training thread spent waiting for it."""

    busy: float = 0.0
    exposed: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_busy(self, seconds: float) -> None:
        with self._lock:
            self.busy += seconds

    def hidden_fraction(self) -> float | None:
        """1 - exposed / busy over what was measured since the last reset (None if nothing was)."""
        if self.busy <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.exposed / self.busy))

    def reset(self) -> None:
        with self._lock:
            self.busy = self.exposed = 0.0


class DataParallel(SkipOnAccumulation):
    """Attach bucketed, overlapped gradient all-reduce to a model, without wrapping it."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        bucket_cap_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        reducer: Reducer | None = None,
        params: list[nn.Parameter] | None = None,
    ):
        self.model = model
        self.group = group
        self.reducer = reducer or NativeReducer(group)
        self._thread = None if self.reducer.asynchronous else CommThread()
        self.last_wire_bytes = 0  # bytes this rank sent in the last step's reductions
        self.overlap = OverlapMeter()  # measured when reductions run on the communication thread
        # `params`: a subset (dense weights over the data-parallel group, experts over their own group)
        self.params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
        if len({p.dtype for p in self.params}) > 1 and reduce_dtype is None:
            raise ConfigError("parameters of several dtypes need an explicit reduce_dtype (gradient_comm.reduce_dtype)")
        self.buckets = make_buckets(self.params, bucket_cap_mb, reduce_dtype)
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self.broadcast_parameters()

    def broadcast_parameters(self) -> None:
        """Make every rank start from the group's first rank's weights."""
        broadcast_module(self.model, self.group, self.params)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        bucket, index = self._slot[id(param)]
        bucket.view(index).copy_(param.grad)
        bucket.captured.add(index)
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            if self._thread is None:
                bucket.work = self.reducer.launch(bucket)
            else:
                bucket.work = self._thread.submit(lambda i=self._next_launch, b=bucket: self._timed_reduce(i, b))
            self._next_launch += 1

    def _timed_reduce(self, index: int, bucket: Bucket) -> None:
        start = time.perf_counter()
        self.reducer.reduce(index, bucket)
        self.overlap.add_busy(time.perf_counter() - start)

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Launch what is left, wait, write back.

        A gradient no hook copied (accumulated under `no_sync`, as a pipeline does for every
        micro-batch, or never produced: zero) is taken from `.grad` now.
        """
        self._fill_uncaptured()
        self._launch_ready()
        self.last_wire_bytes = 0
        for index, bucket in enumerate(self.buckets):
            waited = time.perf_counter()
            with phase(f"all-reduce bucket {index + 1}/{len(self.buckets)}", comm=True):
                bucket.work.wait() if self._thread is None else bucket.work.result()
            self.overlap.exposed += time.perf_counter() - waited
            self.last_wire_bytes += self.reducer.wire_bytes(index, bucket)
            for index, param in enumerate(bucket.params):
                reduced = bucket.view(index)
                if param.grad is None:
                    param.grad = reduced.to(param.dtype).clone()
                else:
                    param.grad.copy_(reduced)
            bucket.ready, bucket.work = 0, None
            bucket.captured.clear()
        self._next_launch = 0

    def _fill_uncaptured(self) -> None:
        for bucket in self.buckets[self._next_launch :]:
            for index, param in enumerate(bucket.params):
                if index in bucket.captured:
                    continue
                if param.grad is None:
                    bucket.view(index).zero_()
                else:
                    bucket.view(index).copy_(param.grad)
            bucket.ready = len(bucket.params)

    def gradient_bytes(self) -> int:
        """Bytes each all-reduce step reduces (sum of bucket sizes)."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def codec_bytes(self) -> int:
        """Bytes a gradient compression codec keeps from step to step (0 without one)."""
        state = getattr(self.reducer, "state_bytes", None)
        return state() if state is not None else 0

    def remove(self) -> None:
        """Detach the gradient hooks and let the communication thread end (the sync's close)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._thread is not None:
            self._thread.close()
            self._thread = None


class DDPSync(GradientSync):
    """Whole weights, gradients and AdamW on every rank; gradients summed by `DataParallel` (none in one process)."""

    kind = "ddp"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ddp: DataParallel | None, norm: GradNorm,
                 tied_group: dist.ProcessGroup | None = None, loss_group: dist.ProcessGroup | None = None,
                 expert_ddp: DataParallel | None = None, replica_sync: Callable[[], None] | None = None):
        super().__init__(model, norm, tied_group, loss_group)
        self.optimizer, self.ddp, self.expert_ddp = optimizer, ddp, expert_ddp  # experts: over their EDP group
        self.replica_sync = replica_sync  # replicated experts (EPLB): summed over their holders
        self.overlap = ddp.overlap if ddp is not None else None
        self.reports_wire_bytes = ddp is not None

    def no_sync(self):
        stack = contextlib.ExitStack()
        for ddp in (self.ddp, self.expert_ddp):
            if ddp is not None:
                stack.enter_context(ddp.no_sync())
        return stack

    def _finish(self) -> None:
        self.wire_bytes = 0
        for ddp in (self.ddp, self.expert_ddp):
            if ddp is not None:
                ddp.finish_gradient_sync()
                self.wire_bytes += ddp.last_wire_bytes
        if self.replica_sync is not None:
            self.replica_sync()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not self.norm.groups and self.norm.weight is None and not self.norm.moe:
            return clip_whole_(params, max_norm)
        dense = [p for p in params if not self.norm.is_expert(p)]
        experts = [p for p in params if self.norm.is_expert(p)]
        squares = sum_of_squares([p.grad for p in dense], [self.norm.of(p) for p in dense])
        expert_squares = sum_of_squares([p.grad for p in experts], [self.norm.of_expert(p) for p in experts])
        norm = self.norm.total(squares, params[0].device if params else torch.device("cpu"),
                               expert_squares=expert_squares)
        clip_([p.grad for p in params], norm, max_norm)
        return norm

    def describe(self) -> str:
        if self.ddp is None:
            return "no data parallelism"
        reducer = getattr(self.ddp.reducer, "describe", lambda: type(self.ddp.reducer).__name__)()
        experts = "" if self.expert_ddp is None else f" (+ {len(self.expert_ddp.buckets)} expert buckets over their EDP group)"
        return f"DDP, {len(self.ddp.buckets)} buckets{experts}, reducer {reducer}"

    def model_state_tensors(self) -> tuple[list, list, list]:
        params = list(self.model.parameters())
        states = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return params, [p.grad for p in params], states

    def state_dict(self, ranks: PieceRanks, fresh: bool = False) -> dict[str, torch.Tensor]:
        return whole_state(self.model, self.optimizer, ranks)

    def load_state_dict(self, state: dict[str, torch.Tensor], ranks: PieceRanks) -> None:
        self.load_pieces(pieces_of_state(self.model, state, ranks))

    def load_pieces(self, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        load_whole_pieces(self.model, self.optimizer, pieces)

    def remove(self) -> None:
        for ddp in (self.ddp, self.expert_ddp):
            if ddp is not None:
                ddp.remove()
