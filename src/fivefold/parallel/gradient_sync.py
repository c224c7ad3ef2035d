"""The gradient-sync interface: how gradients become an optimizer step across data-parallel ranks.

Every data-parallel scheme implements `GradientSync`: our DDP (parallel/data_parallel.py, every
reducer and codec, FIFO or priority scheduling), ZeRO-1/2/3 with offload (parallel/zero.py) and
the parameter server's worker side (parallel/parameter_server.py). The training loop calls it
at fixed points and never asks which one it has (as Megatron-Core's DDP/optimizer pair and
torchtitan's FSDP/DDP wrappers are driven):

    with sync.no_sync(): backward      accumulation micro-steps: no communication
    backward                           the last micro-step: hooks launch the reduction
    sync.finish()                      sum tied copies across pipeline stages, wait for the reduction
    sync.clip_grad_norm_(max_norm)     global L2 norm over every rank holding a part of the model
    sync.step(lr)                      optimizer step, or
    sync.skip_step()                   none: the non-finite guard withholds this step's update
    sync.after_step()                  publish updated weights (ZeRO's all-gather), drop gradients
    sync.flush()                       apply deferred updates (before evaluation, saving, the end)

and, for reporting and checkpoints, `model_state_tensors()` (what the rank holds), `state_dict()`
and `load_pieces()` (the checkpoint's tensors, keyed by parallel/checkpoint_layout.py).

The gradient norm counts every value once over all ranks: the squares of a rank's gradient are
weighted by 1 / (ranks holding that value), summed over the data-parallel shards (ZeRO) and over
the groups holding the other parts (tensor-parallel pieces, pipeline stages).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from fivefold.optim import set_lr
from fivefold.parallel.checkpoint_layout import MOMENTS, PieceRanks
from fivefold.parallel.flat_groups import flat_group_layout, flatten, unflatten
from fivefold.plan.memory import ModelStateBytes
from fivefold.reliability.activity import phase


@dataclass(frozen=True)
class GradNorm:
    """Where the other parts of the model live, and how much each local value counts in the norm.

    Routed experts (mixture-of-experts) are counted apart: each is held whole by one rank of every
    expert-data-parallel group, so their squares are summed over the expert-parallel group and the
    pipeline, never over tensor-parallel ranks (which hold other experts, or the same ones).
    """

    groups: tuple[dist.ProcessGroup, ...] = ()  # tensor-parallel and pipeline groups
    weight: Callable[[nn.Parameter], float] | None = None  # None: every value counts once
    moe: bool = False  # the model has routed experts (every rank then reduces the experts' part)
    expert_groups: tuple[dist.ProcessGroup, ...] = ()  # expert-parallel and pipeline groups
    experts: frozenset[int] = frozenset()  # ids of this rank's expert parameters
    expert_replicas: dict = field(default_factory=dict)  # id -> ranks of the EP group holding that expert (EPLB)

    def of(self, param: nn.Parameter) -> float:
        return 1.0 if self.weight is None else self.weight(param)

    def of_expert(self, param: nn.Parameter) -> float:
        """An expert's weight in the experts' sum over the EP group: 1 / its replicas."""
        return 1.0 / self.expert_replicas.get(id(param), 1)

    def is_expert(self, param: nn.Parameter) -> bool:
        return id(param) in self.experts

    def total(self, local_squares: float, device: torch.device, extra: tuple = (), expert_squares: float = 0.0,
              expert_extra: tuple = ()) -> float:
        """sqrt of the squares summed over `extra` groups (ZeRO's shards) and the model-part groups,
        plus the experts' squares summed over `expert_extra` and the expert groups."""
        total = torch.tensor(local_squares, dtype=torch.float64, device=device)
        for group in (*extra, *self.groups):
            if group is not None:
                with phase("gradient-norm all-reduce", comm=True):
                    dist.all_reduce(total, group=group)
        if self.moe:
            experts = torch.tensor(expert_squares, dtype=torch.float64, device=device)
            for group in (*expert_extra, *self.expert_groups):
                if group is not None:
                    with phase("gradient-norm all-reduce", comm=True):
                        dist.all_reduce(experts, group=group)
            total += experts
        return float(total.sqrt())


def sum_of_squares(tensors: list[torch.Tensor], weights: list[float] | None = None) -> float:
    """Σ weight x ||tensor||², in float64, with one host synchronisation: every tensor's norm from one foreach
    kernel in fp32, as torch's own clip_grad_norm_ (about 1e-6 relative on the sum at `tiny`'s size), not a
    float64 copy of each gradient and a device-to-host copy per tensor (7.5 ms against 1.0 ms over `tiny`'s 3.1M
    gradients on one CPU thread, and on a GPU one synchronisation per parameter)."""
    if not tensors:
        return 0.0
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).double()
    squares = norms * norms
    if weights is not None:
        squares = squares * torch.tensor(weights, dtype=torch.float64, device=squares.device)
    return float(squares.sum())


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale `grads` by max_norm / norm where the norm is above it, in one foreach kernel (as torch's own
    clip_grad_norm_) per device and dtype, equal bit for bit to one multiply per tensor, which cost a MoE step of
    1,575 tensors about 21 ms of kernel launches on an H200 (docs/planner.md). The factor goes in as an fp32
    tensor: as a Python number foreach rounds it to a bf16 list's dtype first (one ulp off a bf16 multiply)."""
    if norm <= max_norm:
        return
    alike: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        alike.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in alike.items():
        torch._foreach_mul_(group, torch.tensor(max_norm / (norm + 1e-6), dtype=torch.float32, device=device))


def clip_whole_(params: list[torch.Tensor], max_norm: float) -> float:
    """The L2 norm of the gradients of `params`, held whole on this rank, scaled to `max_norm` only where the norm
    is above it, by torch's own functions (get_total_norm, clip_grads_with_norm_: bit for bit torch's
    clip_grad_norm_). clip_grad_norm_ itself multiplies every gradient by min(1, max_norm / norm) even when that
    is 1 (with clipping off, max_norm = inf, too): a pass over the gradients that changes nothing, which the
    planner does not price (`Accelerator.clip_seconds`)."""
    with_grads = [p for p in params if p.grad is not None]
    if not with_grads:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grads], 2.0, foreach=True)
    norm = float(total)
    if not norm <= max_norm:  # above the limit, or not finite
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total, foreach=True)
    return norm


def step_tensor(value: float, optimizer: torch.optim.Optimizer | None = None,
                param: torch.Tensor | None = None) -> torch.Tensor:
    """AdamW's step count as torch.optim keeps it: a float32 CPU scalar, or on the parameter's device when
    the optimizer is fused or capturable (the fused CUDA AdamW refuses a CPU step)."""
    on_device = optimizer is not None and param is not None and any(
        g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    return torch.tensor(float(value), dtype=torch.float32, device=param.device if on_device else "cpu")


class GradientSync(abc.ABC):
    """One data-parallel scheme, attached to this rank's model part."""

    gathers_in_forward = False  # ZeRO-3, expert parallelism: every rank must run each forward (evaluation, generation)
    kind = "sync"
    reports_wire_bytes = False  # whether wire_bytes counts this scheme's gradient traffic
    collective_checkpoint = False  # True: every rank holds only its shard, so loading is collective
    reports_grad_norm = True  # False: clip_grad_norm_ returns nan (the norm is not known on this rank)
    can_skip = True  # False: an update cannot be withheld once the gradients are final (parameter servers)

    def __init__(self, model: nn.Module, norm: GradNorm, tied_group: dist.ProcessGroup | None = None,
                 loss_group: dist.ProcessGroup | None = None):
        self.model, self.norm, self.tied_group = model, norm, tied_group
        self.loss_group = loss_group  # ranks whose tokens one gradient is normalised over
        self.wire_bytes = 0  # bytes this rank sent for the last step's gradients
        self.overlap = None  # an OverlapMeter where reductions run on a communication thread
        self.optimizer: torch.optim.Optimizer

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulation micro-steps: no communication (schemes with backward hooks gate them here)."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def finish(self) -> None:
        """After the last backward: sum a tied embedding's two stage copies, then finish the reduction."""
        if self.tied_group is not None:
            weight = self.model.tok_embeddings.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            with phase("tied-embedding all-reduce", comm=True):
                dist.all_reduce(weight.grad, group=self.tied_group)
        self._finish()

    @abc.abstractmethod
    def _finish(self) -> None: ...

    @abc.abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 gradient norm (each value counted once over all ranks); scale to max_norm if above."""

    def step(self, lr: float) -> None:
        """One optimizer step at learning rate `lr` (every model state exists afterwards: measure here)."""
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def skip_step(self) -> None:
        """Withhold this step's update (non-finite guard): weights and optimizer states stay; `after_step` follows."""

    def after_step(self) -> None:
        """Drop gradients; bring updated weights where the next forward reads them."""
        self.optimizer.zero_grad(set_to_none=True)

    def flush(self) -> None:
        """Apply any deferred update now (evaluation, checkpoints and the end of training call this)."""

    def close(self) -> None:
        """Release what the sync holds (the end of training calls this): its hooks and threads (`remove`), and in
        subclasses what it holds outside the process's memory. The hooks point back at the sync from the model's
        parameters and modules: left in place, they keep the model, its gradients and the optimizer's states alive
        after the trainer is dropped, until a garbage collection finds the cycle."""
        self.remove()

    def describe(self) -> str:
        return self.kind

    def traffic_metrics(self) -> dict[str, int]:
        """Bytes this rank sent in the gradient sync's collectives since the last call, for the step's metrics."""
        return {}

    @abc.abstractmethod
    def model_state_tensors(self) -> tuple[list, list, list]:
        """(parameters, gradients, optimizer states) tensors this rank holds, for byte counting."""

    def expected_model_states(self, parameters: int) -> ModelStateBytes:
        """The ZeRO paper's formula for this scheme, for `parameters` on this rank (before padding)."""
        from fivefold.plan.memory import zero_model_states

        return zero_model_states(parameters, 0, 1, False)

    @abc.abstractmethod
    def state_dict(self, ranks: PieceRanks) -> dict[str, torch.Tensor]:
        """This rank's part of the checkpoint (DCP state dict; keys from ShardKey)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor], ranks: PieceRanks) -> None:
        """Take the tensors DCP loaded into a `state_dict(...)`-shaped dict."""

    @abc.abstractmethod
    def load_pieces(self, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take whole flat groups of this rank's model part: group key -> {kind: unpadded flat tensor}."""

    def remove(self) -> None:
        """Detach hooks and threads."""


# ------------------------------------------------- whole tensors on every rank (DDP, PS worker, one process)
def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ranks: PieceRanks) -> dict[str, torch.Tensor]:
    """Every flat group of the model whole: weights, AdamW moments (zero without an optimizer) and step."""
    params = dict(model.named_parameters())
    out = {}
    for group in flat_group_layout(model):
        members = [params[name] for name in group.names]
        states = [optimizer.state.get(p, {}) if optimizer is not None else {} for p in members]
        key = ranks.key(group.key)
        out[key.tensor("model")] = flatten(members)
        for moment in MOMENTS:
            out[key.tensor(moment)] = flatten([s.get(moment, torch.zeros_like(p)) for s, p in zip(states, members)])
        out[key.tensor("step")] = step_tensor(max((float(s["step"]) for s in states if "step" in s), default=0.0))
    return out


@torch.no_grad()
def load_whole_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    for group in flat_group_layout(model):
        piece = pieces[group.key]
        moments = {m: unflatten(group, piece[m]) for m in MOMENTS}
        for name, value in unflatten(group, piece["model"]).items():
            param = params[name]
            param.copy_(value)
            optimizer.state[param] = {"step": step_tensor(piece["step"], optimizer, param),
                                      **{m: moments[m][name].to(param.device, param.dtype).clone() for m in MOMENTS}}


def pieces_of_state(model: nn.Module, state: dict[str, torch.Tensor], ranks: PieceRanks) -> dict[str, dict[str, torch.Tensor]]:
    """A whole-tensor state dict regrouped as group key -> {kind: tensor}."""
    return {g.key: {kind: state[ranks.key(g.key).tensor(kind)] for kind in ("model", *MOMENTS, "step")}
            for g in flat_group_layout(model)}
