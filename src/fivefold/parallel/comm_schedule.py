"""Priority scheduling of gradient communication (P3, Jayarajan et al. 2019; ByteScheduler, Peng et al. 2019).

Wait-free backprop (FIFO, parallel/data_parallel.py) sends buckets in the order backward fills
them: last layers first. But the next forward needs the first layers first, so it must wait for
everything. Here each bucket is cut into slices; a slice's priority is the forward position of its
first parameter, and whenever the link is free the most urgent slice ready on every rank goes
next, so the first layers' gradients overtake the backlog of the last layers'. The optimizer
update is deferred per module: the next forward of a module waits only for the slices holding its
own parameters, updates them, and runs, while later slices are still on the wire.

Every rank must reduce the same slices in the same order, but readiness differs between ranks.
The thread communicates on a process group of its own (`Mesh.private_copy`), since it is still busy
while the training thread starts the next step's collectives.
As Horovod's coordinator does, the communication thread negotiates: each round it sums a
readiness vector over the group (one small all-reduce, MIN), then reduces the most urgent slice
that is ready everywhere. All ranks see the same vector, so all pick the same slice.

The update of a parameter needs only its own reduced gradient, so gradient clipping by the global
norm (which needs all of them first) cannot be combined with this schedule; the config refuses it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fivefold.comm.reducers import CommThread
from fivefold.optim import set_lr
from fivefold.parallel.data_parallel import DataParallel, DDPSync


SCHEDULES = ("fifo", "priority")  # gradient_comm.schedule: FIFO is DataParallel's own order


@dataclass(frozen=True)
class Slice:
    bucket: int
    lo: int
    hi: int
    priority: int  # forward position of its first parameter: lower goes first


def plan_slices(ddp: DataParallel, slice_elements: int) -> list[Slice]:
    order = {id(p): i for i, p in enumerate(ddp.params)}  # registration order = forward order
    slices = []
    for b, bucket in enumerate(ddp.buckets):
        starts = sorted((off, order[id(p)]) for p, off in zip(bucket.params, bucket.offsets))
        total = bucket.buffer.numel()
        lo = 0
        while lo < total:
            hi = min(total, lo + slice_elements)
            first = max(i for i, (off, _) in enumerate(starts) if off <= lo)
            covered = [pos for off, pos in starts[first:] if off < hi]
            slices.append(Slice(b, lo, hi, min(covered)))
            lo = hi
    return slices


class PriorityDataParallel(DataParallel):
    """DDP whose gradient slices go in next-forward order, with per-module deferred updates."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, bucket_cap_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None, reducer=None, slice_mb: float = 1.0):
        super().__init__(model, group, bucket_cap_mb, reduce_dtype, reducer)
        if self._thread is None:  # the backend's asynchronous path cannot be re-ordered: run it on the thread
            self._thread = CommThread()
        element = self.buckets[0].buffer.element_size() if self.buckets else 4
        self.slices = plan_slices(self, max(1, int(slice_mb * 2**20) // element))
        self._cond = threading.Condition()
        self._ready: set[int] = set()  # slices whose bucket is complete on this rank
        self._done_events = [threading.Event() for _ in self.slices]
        self._job = None
        self._pending_update: Callable[[list[nn.Parameter]], None] | None = None
        self._updated: set[int] = set()
        self.order_log: list[list[int]] = []  # slices in the order they were reduced, per step
        self._slices_of = {}  # parameter -> the slices its gradient lies in
        for b, bucket in enumerate(self.buckets):
            for param, lo in zip(bucket.params, bucket.offsets):
                hi = lo + param.numel()
                self._slices_of[id(param)] = [k for k, s in enumerate(self.slices) if s.bucket == b and s.lo < hi and s.hi > lo]
        self._pre_hooks = [m.register_forward_pre_hook(self._before_forward) for m in model.modules()
                           if any(p.requires_grad for p in m.parameters(recurse=False))]

    # ---------------------------------------------------------------- backward: slices become ready
    def _launch_ready(self) -> None:
        newly = []
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                break
            newly.extend(k for k, s in enumerate(self.slices) if s.bucket == self._next_launch)
            self._next_launch += 1
        if newly:
            with self._cond:  # all at once: what became ready together competes by priority alone
                self._ready.update(newly)
                self._cond.notify()
        if self._job is None:
            self._job = self._thread.submit(self._negotiate_and_reduce)

    def _negotiate_and_reduce(self) -> None:
        order, done = [], set()
        while len(done) < len(self.slices):
            with self._cond:  # ready sets are prefixes of one bucket order, so once every rank has one, they meet
                while not (self._ready - done):
                    self._cond.wait()
                mine = torch.tensor([1 if k in self._ready and k not in done else 0 for k in range(len(self.slices))],
                                    dtype=torch.int32)
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.group)
            everywhere = [k for k in range(len(self.slices)) if mine[k]]
            if not everywhere:
                continue
            k = min(everywhere, key=lambda k: (self.slices[k].priority, k))
            s = self.slices[k]
            start = time.perf_counter()
            self.reducer.all_reduce(self.buckets[s.bucket].buffer[s.lo:s.hi])
            self.overlap.add_busy(time.perf_counter() - start)
            done.add(k)
            order.append(k)
            self._done_events[k].set()
        self.order_log.append(order)

    # ---------------------------------------------------------------- after backward: defer updates
    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Hand what is left to the thread; do not wait (each module waits for its own slices)."""
        self._fill_uncaptured()
        self._launch_ready()
        self.last_wire_bytes = sum(self.reducer.wire_bytes(i, b) for i, b in enumerate(self.buckets))
        for param in self.params:
            param.grad = None  # the reduced gradient is written back when the parameter is updated

    def defer_update(self, update: Callable[[list[nn.Parameter]], None]) -> None:
        """Apply `update(params)` to each module's parameters just before its next forward."""
        self._pending_update = update
        self._updated.clear()

    def _before_forward(self, module: nn.Module, args) -> None:
        if self._pending_update is not None:
            self._apply([p for p in module.parameters(recurse=False) if p.requires_grad])

    @torch.no_grad()
    def _apply(self, params: list[nn.Parameter]) -> None:
        todo = [p for p in params if id(p) not in self._updated]
        if not todo:
            return
        waited = time.perf_counter()
        for p in todo:
            for k in self._slices_of[id(p)]:
                self._done_events[k].wait()
        self.overlap.exposed += time.perf_counter() - waited
        for p in todo:
            bucket, index = self._slot[id(p)]
            p.grad = bucket.view(index).to(p.dtype).clone()
        self._pending_update(todo)
        for p in todo:
            p.grad = None
            self._updated.add(id(p))
        if len(self._updated) == len(self.params):
            self._end_step()

    def flush(self) -> None:
        """Apply every deferred update now (before evaluation, checkpoints, the end of training)."""
        if self._pending_update is not None:
            self._apply(list(self.params))

    def _end_step(self) -> None:
        waited = time.perf_counter()
        self._job.result()
        self.overlap.exposed += time.perf_counter() - waited
        self._job, self._pending_update = None, None
        self._ready.clear()
        for event in self._done_events:
            event.clear()
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None
            bucket.captured.clear()
        self._next_launch = 0

    def remove(self) -> None:
        for hook in self._pre_hooks:
            hook.remove()
        super().remove()


class PrioritySync(DDPSync):
    """DDPSync whose optimizer step is deferred per module to its next forward (no global clipping)."""

    kind = "ddp-priority"
    ddp: PriorityDataParallel
    reports_grad_norm = False

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Not computed: gradients are still on the wire (the config requires train.max_grad_norm = 0)."""
        return float("nan")

    def step(self, lr: float) -> None:
        def update(params: list[nn.Parameter]) -> None:  # AdamW on these parameters only; the others have no gradient
            set_lr(self.optimizer, lr)
            self.optimizer.step()

        self.ddp.defer_update(update)

    def skip_step(self) -> None:
        """Each module still takes its reduced slices at its next forward, and leaves its parameters as they are."""
        self.ddp.defer_update(lambda params: None)

    def flush(self) -> None:
        self.ddp.flush()

    def model_state_tensors(self) -> tuple[list, list, list]:
        """Between steps the reduced gradients wait in DDP's buckets (each parameter's gradient is set only for its
        update, then dropped): those are this scheme's gradient bytes."""
        params, _, states = super().model_state_tensors()
        return params, [bucket.buffer for bucket in self.ddp.buckets], states

    def describe(self) -> str:
        return super().describe() + f", priority schedule over {len(self.ddp.slices)} slices"
