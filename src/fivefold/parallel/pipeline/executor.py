"""Run a pipeline schedule's instruction stream on torch.distributed.

Each pipeline rank walks its own stream (schedules.py) in order:

    recv_act / recv_grad   post an irecv into a fresh buffer of the activation's shape
    send_act / send_grad   post an isend of the stage output / of the input gradient
    F                      the stage forward; on the last stage, the loss sum over the
                           micro-batch's target tokens, divided by the step's total target
                           tokens (token-weighted, as the trainer does without pipelining)
    B                      backward from the saved output with the received gradient
    I, W                   B split (zero bubble): I computes the input gradient (and the norm
                           and embedding gradients), W the matrix weights' gradients later
    reduce_grads           wait for the sends; call the trainer's gradient sync (tied embedding,
                           DDP / ZeRO over the data-parallel group)
    optimizer_step         call the trainer's optimizer step

Communication instructions that follow each other are posted together with one
`batch_isend_irecv` when the next compute instruction (or the end) is reached, so a forward's
send and the next backward's receive travel together (Megatron-LM's send_forward_recv_backward);
a compute waits only for the receives it needs, sends are waited for at the end of the step.
All messages between two ranks use one tag: the order the streams post them in is the order they
are matched in (the simulator checks the streams are FIFO per channel, as NCCL requires).

Scatter/gather (pipeline_parallel.scatter_gather; Narayanan et al., SC21, section 4.1): without
sequence parallelism a stage's output, and the gradient of its input, are whole and equal on every
tensor-parallel rank, so each tp rank sends only its 1/tp contiguous piece of the flattened tensor to
the same tp rank of the next (previous) stage, and the receivers all-gather the pieces over their tp
group once the receives are in, before the compute that needs them. Between stages (across nodes,
as Megatron-LM lays them out) tp times fewer bytes travel; the all-gather stays inside the node.

The I/W split: while a zero-bubble schedule runs F or I, `F.linear` calls on weights that
require grad go through `_DeferredLinear`, whose backward returns the input gradient and keeps
(input, output gradient) for W; W computes each weight's gradient as grad^T x and hands it to
autograd (`torch.autograd.backward` on the weights), so accumulation, hooks and any
gradient-reducing view in between (tensor parallelism's replicated key/value heads) behave as in
an ordinary backward. This is how Qi et al. split the backward in Megatron-LM (a weight-gradient
store), applied from outside through a TorchFunctionMode rather than by editing the layers.

Every instruction is timed (host clock; on CUDA with a device synchronise when tracing): the
trainer turns the times into the measured bubble and the Chrome trace (pipeline/trace.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fivefold.comm.native import all_gather_flat
from fivefold.parallel.pipeline.schedules import Instruction, Op, PipelineShape, schedule
from fivefold.parallel.pipeline.stages import PipelineStage
from fivefold.reliability.activity import phase


@dataclass
class MicroBatch:
    """A micro-batch as every pipeline rank sees it: token ids, labels, and the tokens' positions."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None  # None: 0 .. seq-1 (no context parallelism)

    def __post_init__(self) -> None:
        if self.positions is None:
            self.positions = torch.arange(self.inputs.shape[1], device=self.inputs.device)


@dataclass
class TimedEvent:
    """One instruction as it ran: seconds from the start of the step."""

    name: str
    category: str  # "compute" or "comm"
    start: float
    end: float


# ------------------------------------------------------------------------- split backward (I / W)
class WeightGradStore:
    """(weight, input, output gradient) of every deferred matmul, per (stage, micro-batch)."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None  # set while an I pass runs
        self.entries: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        # Bytes of the inputs and output gradients waiting for their W pass (held outside autograd),
        # each storage once (q, k and v projections share their input).
        self.held_bytes = 0
        self.peak_bytes = 0
        self._holders: dict[int, int] = {}

    def _hold(self, tensor: torch.Tensor, delta: int) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        count = self._holders.get(ptr, 0) + delta
        if count == 0:
            del self._holders[ptr]
            self.held_bytes -= storage.nbytes()
        else:
            if count == 1 and delta == 1:
                self.held_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self._holders[ptr] = count

    def add(self, weight: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> None:
        self.entries.setdefault(self.key, []).append((weight, x, grad))
        self._hold(x, 1)
        self._hold(grad, 1)

    def pending(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def compute(self, key: tuple[int, int]) -> None:
        """The W pass of one (stage, micro-batch): every deferred weight gradient, accumulated by autograd."""
        weights, grads, index = [], [], {}
        for weight, x, grad in self.entries.pop(key, []):
            self._hold(x, -1)
            self._hold(grad, -1)
            g = grad.flatten(0, -2).t().matmul(x.flatten(0, -2).to(grad.dtype)).to(weight.dtype)
            if id(weight) in index:
                grads[index[id(weight)]] += g
            else:
                index[id(weight)] = len(weights)
                weights.append(weight)
                grads.append(g)
        if weights:
            torch.autograd.backward(weights, grads)


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T whose backward gives dL/dx now and leaves dL/dW to the W pass (when one is running)."""

    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.store = weight, store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        grad_x = grad.matmul(weight.to(grad.dtype)).to(x.dtype)
        if ctx.store.key is not None:
            ctx.store.add(weight, x, grad)
            return grad_x, None, None
        grad_w = grad.flatten(0, -2).t().matmul(x.flatten(0, -2).to(grad.dtype)).to(weight.dtype)
        return grad_x, grad_w, None


class _DeferWeightGradients(TorchFunctionMode):
    """Route bias-free `F.linear` calls on trainable weights through _DeferredLinear."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is None and weight.requires_grad:
                return _DeferredLinear.apply(x, weight, self.store)
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------------ executor
@dataclass
class _Pending:
    ops: list[dist.P2POp] = field(default_factory=list)
    receives: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # labels for the trace
    sends: list[torch.Tensor] = field(default_factory=list)
    gathers: list[tuple[str, int, int]] = field(default_factory=list)  # inbox keys holding a scattered piece


class PipelineExecutor:
    """Runs one rank's instruction stream for each optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[PipelineStage],
        shape: PipelineShape,
        schedule_name: str,
        group: dist.ProcessGroup,
        loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        activation_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        scatter_group: dist.ProcessGroup | None = None,
    ):
        """scatter_group: the tensor-parallel group messages are scattered over (pipeline_parallel.scatter_gather)."""
        self.model, self.shape, self.group = model, shape, group
        self.rank = dist.get_rank(group)
        self.stages = {stage.index: stage for stage in stages}
        self.stream: list[Instruction] = schedule(schedule_name, shape, self.rank)
        self.loss_sum, self.autocast = loss_sum, autocast
        # whether the last stage applies the output projection (False: the loss does, parallel/output_loss.py);
        # a plain (logits, labels) function, as benchmarks pass, wants logits
        self.project = getattr(loss_sum, "project", True)
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        self.scatter_group = scatter_group
        self.pieces = dist.get_world_size(scatter_group) if scatter_group is not None else 1
        if self.pieces > 1 and math.prod(activation_shape) % self.pieces:
            raise ValueError(f"a stage's activation {activation_shape} does not split into {self.pieces} equal pieces")
        self.global_rank = {r: dist.get_global_rank(group, r) for r in range(shape.ranks)}
        self.store = WeightGradStore()
        self.splits_backward = any(i.op == Op.BACKWARD_INPUT for i in self.stream)
        self.synchronize = False  # set by the trainer when tracing on CUDA: time device work, not launches
        self.events: list[TimedEvent] = []
        self.peak_in_flight = 0
        self.loss_factor: float | None = None  # multiplies each micro-batch's loss before backward (fault injection)

    # ----------------------------------------------------------------------- one training step
    def run(self, batches: list[MicroBatch], total_tokens: int, reduce_grads: Callable[[], None],
            optimizer_step: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Run the stream; returns this rank's summed loss (zero unless it holds the last stage).

        `optimizer_step` receives that loss sum (complete by then: the step is the stream's last instruction).
        """
        if len(batches) != self.shape.microbatches:
            raise ValueError(f"the schedule runs {self.shape.microbatches} micro-batches, got {len(batches)}")
        self.events = []
        self.peak_in_flight = 0
        self._t0 = time.perf_counter()
        self._inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._send_works: list[tuple[dist.Work, torch.Tensor]] = []
        loss = torch.zeros((), device=self.device, dtype=torch.float32)
        pending = _Pending()
        # One autocast region around the step's compute: autocast's cache of bf16 weight copies lasts one region,
        # so the micro-batches in flight share one copy of each weight instead of keeping one each (a 1F1B first
        # rank held p). Backward and the loss run with autocast off inside it, as they would outside; the region
        # closes before the gradients are reduced and the weights updated.
        region = contextlib.ExitStack()
        region.enter_context(self.autocast())
        try:
            loss = self._run_stream(batches, total_tokens, reduce_grads, optimizer_step, loss, pending, region)
        finally:
            region.close()
        return loss

    def _outside_autocast(self) -> contextlib.AbstractContextManager:
        """autocast off inside the step's region (a nested region: leaving it keeps the region's cache)."""
        return torch.autocast(self.device.type, enabled=False)

    def _run_stream(self, batches, total_tokens, reduce_grads, optimizer_step, loss, pending, region) -> torch.Tensor:
        for ins in self.stream:
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                buffer = self._receive_buffer()
                kind = "act" if ins.op == Op.RECV_ACT else "grad"
                self._inbox[(kind, ins.stage, ins.microbatch)] = buffer
                if self.pieces > 1:
                    pending.gathers.append((kind, ins.stage, ins.microbatch))
                pending.ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank[ins.peer], self.group))
                pending.receives.append((str(ins), buffer))
            elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                key = (ins.stage, ins.microbatch)
                tensor = self._saved[key][1].detach() if ins.op == Op.SEND_ACT else self._input_grads.pop(key)
                tensor = self._piece(tensor.contiguous())
                pending.ops.append(dist.P2POp(dist.isend, tensor, self.global_rank[ins.peer], self.group))
                pending.sends.append(tensor)
            elif ins.op == Op.FORWARD:
                pending = self._flush(pending)
                loss += self._timed(str(ins), "compute", lambda: self._forward(ins, batches, total_tokens))
            elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                pending = self._flush(pending)
                with self._outside_autocast():
                    self._timed(str(ins), "compute", lambda: self._backward(ins))
            elif ins.op == Op.BACKWARD_WEIGHT:
                pending = self._flush(pending)
                with self._outside_autocast():
                    self._timed(str(ins), "compute", lambda: self.store.compute((ins.stage, ins.microbatch)))
            elif ins.op == Op.REDUCE_GRADS:
                region.close()  # every forward is done: the copies go with the last backward's graph
                pending = self._flush(pending)
                self._timed("wait sends", "comm", self._wait_sends)
                self._check_drained()
                self._timed("reduce grads", "comm", reduce_grads)
            elif ins.op == Op.OPTIMIZER_STEP:
                region.close()
                self._timed("optimizer step", "compute", lambda: optimizer_step(loss))
        return loss

    def _timed(self, name: str, category: str, fn: Callable):
        start = time.perf_counter()
        out = fn()
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.events.append(TimedEvent(name, category, start - self._t0, time.perf_counter() - self._t0))
        return out

    def _flush(self, pending: _Pending) -> _Pending:
        """Post the batched sends and receives; wait for the receives (the next compute needs them)."""
        if not pending.ops:
            return pending
        start = time.perf_counter()
        works = dist.batch_isend_irecv(pending.ops)
        receive_works = []
        for op, work in zip(pending.ops, works):
            if op.op is dist.isend:
                self._send_works.append((work, op.tensor))
            else:
                receive_works.append(work)
        names = ", ".join(name for name, _ in pending.receives) or "post sends"
        with phase(f"pipeline {names}", comm=True):
            for work in receive_works:
                work.wait()
            for key in pending.gathers:
                self._inbox[key] = self._gather(self._inbox[key])
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.events.append(TimedEvent(names, "comm", start - self._t0, time.perf_counter() - self._t0))
        self._send_works = [(w, t) for w, t in self._send_works if not w.is_completed()]
        return _Pending()

    # ------------------------------------------------------------------------ scatter / gather
    def _receive_buffer(self) -> torch.Tensor:
        """A buffer for one incoming message: the whole activation, or this rank's piece of it."""
        if self.pieces == 1:
            return torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        return torch.empty(math.prod(self.activation_shape) // self.pieces, dtype=self.dtype, device=self.device)

    def _piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """What this rank sends of a whole (tp-replicated) contiguous tensor: all of it, or its piece (a view)."""
        if self.pieces == 1:
            return tensor
        return tensor.view(-1).chunk(self.pieces)[dist.get_rank(self.scatter_group)]

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every tp rank's piece (each received from its own peer in the other stage)."""
        whole = torch.empty(piece.numel() * self.pieces, dtype=piece.dtype, device=piece.device)
        all_gather_flat(whole, piece, group=self.scatter_group)
        return whole.view(self.activation_shape)

    def _wait_sends(self) -> None:
        with phase(f"pipeline wait for {len(self._send_works)} sends", comm=True):
            for work, _ in self._send_works:
                work.wait()
        self._send_works = []

    def _check_drained(self) -> None:
        left = len(self._saved) + len(self._inbox) + len(self._input_grads) + self.store.pending()
        if left:
            raise RuntimeError(f"pipeline rank {self.rank}: {left} activations or gradients left at the end of the "
                               "step: the schedule is incomplete")

    def _deferring(self):
        return _DeferWeightGradients(self.store) if self.splits_backward else contextlib.nullcontext()

    def _forward(self, ins: Instruction, batches: list[MicroBatch], total_tokens: int) -> torch.Tensor:
        stage, batch = self.stages[ins.stage], batches[ins.microbatch]
        if stage.is_first:
            x = batch.inputs
        else:
            x = self._inbox.pop(("act", ins.stage, ins.microbatch)).requires_grad_()
        with self._deferring(), self.autocast():
            out = stage.forward(self.model, x, batch.positions, self.project)
        loss = torch.zeros((), device=self.device)
        if stage.is_last:
            with self._outside_autocast():
                loss = self.loss_sum(out, batch.labels)
            if self.loss_factor is not None:
                loss = loss * self.loss_factor
            out = loss / total_tokens
        self._saved[(ins.stage, ins.microbatch)] = (None if stage.is_first else x, out)
        self.peak_in_flight = max(self.peak_in_flight, len(self._saved))
        return loss.detach()

    def _backward(self, ins: Instruction) -> None:
        key = (ins.stage, ins.microbatch)
        stage = self.stages[ins.stage]
        x, out = self._saved.pop(key)
        grad = None if stage.is_last else self._inbox.pop(("grad", ins.stage, ins.microbatch))
        if ins.op == Op.BACKWARD_INPUT:
            self.store.key = key
            try:
                with self._deferring():
                    torch.autograd.backward(out, grad)
            finally:
                self.store.key = None
        else:
            torch.autograd.backward(out, grad)
        if not stage.is_first:
            self._input_grads[key] = x.grad

    # --------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def forward_only(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Loss sum of the batches (on the last stage's rank; zero elsewhere), each through every stage in turn."""
        loss = torch.zeros((), device=self.device, dtype=torch.float64)
        sends = []
        for batch in batches:
            for index in range(self.shape.stages):
                stage = self.stages.get(index)
                if stage is None:
                    continue
                if stage.is_first:
                    x = batch.inputs
                else:
                    x = self._receive_buffer()
                    dist.recv(x, self.global_rank[self.shape.rank_of(index - 1)], group=self.group)
                    if self.pieces > 1:
                        x = self._gather(x)
                with self.autocast():
                    out = stage.forward(self.model, x, batch.positions, self.project)
                if stage.is_last:
                    loss += self.loss_sum(out, batch.labels).double()
                else:
                    out = self._piece(out.contiguous())
                    sends.append((dist.isend(out, self.global_rank[self.shape.rank_of(index + 1)], group=self.group), out))
        for work, _ in sends:
            work.wait()
        return loss
