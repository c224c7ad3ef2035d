"""The forward-backward step, chosen once when the model is parallelized (Megatron-Core's get_forward_backward_func).

Both kinds are called the same way every optimizer step, so the training loop has no pipeline
branch:

    loss_sum = step(batches, total_tokens, update, measure)

`batches` are this rank's (inputs, labels, positions) micro-batches; each micro-batch's summed
token cross-entropy is divided by `total_tokens`, the step's target tokens over the sync's loss
group (token-weighted, so accumulation, data parallelism and uneven micro-batches all give the
full-batch gradient). `update(local_loss_sum)` is called once the gradients are final (the
non-finite guard's check, clip, optimizer step), with this rank's own loss sum: right after the
last backward for a single stage, at the schedule's OptimizerStep instruction for a pipeline. The
returned loss sum is already summed over every rank that holds a part of it. `loss_factor`, when
set, multiplies each micro-batch's loss before backward (fault injection: NaN or a spike).

    SingleStageStep   every micro-batch forward and backward through the whole local model
    PipelineStep      the schedule's instruction stream (parallel/pipeline/executor.py); on
                      `measure` steps every instruction is timed and the events are gathered
                      over the pipeline group (`events`), which reporting turns into the bubble
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fivefold.parallel.gradient_sync import GradientSync
from fivefold.parallel.output_loss import OutputLoss
from fivefold.parallel.pipeline.executor import MicroBatch, PipelineExecutor
from fivefold.parallel.tensor_parallel import IGNORE_INDEX
from fivefold.reliability.activity import phase

Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def _sum(value: torch.Tensor, group: dist.ProcessGroup | None, what: str = "loss all-reduce") -> torch.Tensor:
    if group is not None:
        with phase(what, comm=True):
            dist.all_reduce(value, group=group)
    return value


def target_tokens(batches: list[Batch]) -> int:
    return sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in batches)


class SingleStageStep:
    """Forward and backward of every micro-batch through the whole local model."""

    schedule = None

    def __init__(self, model: nn.Module, loss_sum: OutputLoss, sync: GradientSync, autocast: Callable,
                 dp_rank: int, dp: int, data_group: dist.ProcessGroup | None):
        self.model, self.loss_sum, self.sync, self.autocast = model, loss_sum, sync, autocast
        self.dp_rank, self.dp, self.data_group = dp_rank, dp, data_group
        self.loss_factor: float | None = None

    def __call__(self, batches: list[Batch], total_tokens: int, update: Callable[[torch.Tensor], None],
                 measure: bool = False) -> torch.Tensor:
        device = batches[0][0].device
        loss_sum = torch.zeros((), device=device)
        for micro_step, (inputs, labels, positions) in enumerate(batches):
            accumulating = micro_step < len(batches) - 1
            with self.sync.no_sync() if accumulating else contextlib.nullcontext():
                with phase(f"forward micro-batch {micro_step + 1}/{len(batches)}"), self.autocast():
                    out = self.model(inputs, positions=positions, project=self.loss_sum.project)
                loss = self.loss_sum(out, labels)
                del out  # the logits: held here they would live through backward (2 N V bytes more at a bf16 peak)
                if self.loss_factor is not None:
                    loss = loss * self.loss_factor
                with phase(f"backward micro-batch {micro_step + 1}/{len(batches)}"):
                    (loss / total_tokens).backward()
            loss_sum += loss.detach()
        with phase("gradient sync"):
            self.sync.finish()
        update(loss_sum)
        return _sum(loss_sum, self.sync.loss_group)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        """(loss sum, target tokens) over all data- and context-parallel ranks; rank r takes every dp-th batch.

        A scheme that gathers weights inside forward (ZeRO-3) needs every rank in every forward,
        so a rank left without a batch runs (and discards) one to keep in step.
        """
        totals = torch.zeros(2, dtype=torch.float64, device=batches[0][0].device)
        rounds = -(-len(batches) // self.dp)
        for index in range(self.dp_rank, rounds * self.dp, self.dp):
            counted = index < len(batches)
            if not counted and not self.sync.gathers_in_forward:
                continue
            inputs, labels, positions = batches[index] if counted else batches[0]
            with self.autocast():
                out = self.model(inputs, positions=positions, project=self.loss_sum.project)
            if counted:
                totals[0] += self.loss_sum(out, labels).double()
                totals[1] += target_tokens([batches[index]])
        _sum(totals, self.data_group, "evaluation all-reduce")
        return float(totals[0]), int(totals[1])


class PipelineStep:
    """One optimizer step as the pipeline schedule's instruction stream for this rank."""

    def __init__(self, executor: PipelineExecutor, schedule: str, sync: GradientSync,
                 pp_group: dist.ProcessGroup, dp_rank: int, dp: int, data_group: dist.ProcessGroup | None):
        self.executor, self.schedule, self.sync, self.pp_group = executor, schedule, sync, pp_group
        self.dp_rank, self.dp, self.data_group = dp_rank, dp, data_group
        self.events: list | None = None  # every pipeline rank's timed events of the last measured step

    @property
    def shape(self):
        return self.executor.shape

    @property
    def loss_factor(self) -> float | None:
        return self.executor.loss_factor

    @loss_factor.setter
    def loss_factor(self, value: float | None) -> None:
        self.executor.loss_factor = value

    def __call__(self, batches: list[Batch], total_tokens: int, update: Callable[[torch.Tensor], None],
                 measure: bool = False) -> torch.Tensor:
        self.executor.synchronize = measure
        if measure:
            with phase("pipeline barrier", comm=True):
                dist.barrier(group=self.pp_group)  # one time origin for every stage's events
        with self.sync.no_sync():  # the schedule's ReduceGrads instruction finishes the sync once
            loss_sum = self.executor.run([MicroBatch(*b) for b in batches], total_tokens, self.sync.finish, update)
        _sum(loss_sum, self.sync.loss_group)
        _sum(loss_sum, self.pp_group, "pipeline loss all-reduce")  # only the last stage holds a loss
        if measure:
            events: list = [None] * self.shape.ranks
            with phase("pipeline events gather", comm=True):
                dist.all_gather_object(events, self.executor.events, group=self.pp_group)
            self.events = events
        return loss_sum

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> tuple[float, int]:
        """The batches flow through the stages; the loss sum lands on the last, the token count is everywhere."""
        mine = [batches[i] for i in range(self.dp_rank, len(batches), self.dp)]
        totals = torch.zeros(2, dtype=torch.float64, device=batches[0][0].device)
        totals[0] += self.executor.forward_only([MicroBatch(*b) for b in mine])
        missing = -(-len(batches) // self.dp) - len(mine)
        if missing and self.sync.gathers_in_forward:  # peers need this rank in every forward: run one, discard it
            self.executor.forward_only([MicroBatch(*batches[0])] * missing)
        totals[1] += target_tokens(mine)
        _sum(totals, self.data_group, "evaluation all-reduce")
        totals[0] = _sum(totals[0].clone(), self.pp_group, "evaluation all-reduce")
        return float(totals[0]), int(totals[1])
