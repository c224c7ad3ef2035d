"""ZeRO stages 1, 2 and 3 with optional CPU offload (Rajbhandari et al. 2020; Ren et al. 2021, ZeRO-Offload).

The model's parameters are packed into flat groups, one per (unit, weight-decay class), where a
unit is a transformer block or the rest of the model (embedding, final norm, head). Each flat
group is padded to a multiple of the shard degree N and split into N equal shards; rank r owns
shard r, and the optimizer (AdamW, decoupled decay per group) steps only the fp32 master copy of
its shard.

    stage 1: parameters and gradients whole on every rank; gradients all-reduced (once, after the
             last micro-batch), each rank updates its shard, updated shards are all-gathered.
    stage 2: gradients reduce-scattered as soon as a group's gradients are ready (every
             micro-batch, accumulated into the shard); full gradients are freed at once.
    stage 3: parameters sharded too. A unit's parameters are all-gathered before its forward and
             freed after it, gathered again before its backward, and freed after its gradients
             are reduce-scattered; the next unit's gather is prefetched asynchronously.

Bytes per parameter held by one rank (Psi parameters, N shards, K = 12 for mixed-precision Adam:
fp32 master, momentum, variance), as in the ZeRO paper; padding adds at most N - 1 elements
per flat group:
    mixed precision (bf16 weights): stage 1 2 + 2 + 12/N; stage 2 2 + 14/N; stage 3 16/N
    fp32 weights (master aliases the weights): stage 1 4 + 4 + 8/N; stage 2 4 + 12/N; stage 3 16/N
With offload, masters, optimizer states and the step live on the CPU (ZeRO-Offload); gradient
shards go to the CPU for the step and updated shards come back.

Gradients are SUMMED over the data-parallel ranks (the trainer divides the loss by the global
token count). With dp_replicate > 1 (hybrid sharding), each shard is then all-reduced across
the replicas.

Stage 3 takes the ZeRO++ methods (quantised weight gathers, a secondary partition within the
node for backward gathers, quantised hierarchical gradient reduce-scatter): parallel/zero_pp.py.
Every collective's bytes are counted per phase and per kind of group in `traffic`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.tensor import DTensor, Replicate, Shard

from fivefold.errors import ConfigError
from fivefold.optim import set_lr
from fivefold.parallel.checkpoint_layout import MOMENTS, PieceRanks
from fivefold.parallel.collectives import all_gather_flat, reduce_scatter_flat
from fivefold.parallel.data_parallel import SkipOnAccumulation, broadcast_module
from fivefold.parallel.flat_groups import GroupLayout, flat_group_layout, units
from fivefold.parallel.gradient_sync import GradientSync, GradNorm, clip_, step_tensor, sum_of_squares
from fivefold.parallel.zero_pp import (ZeroPPGroups, ZeroPPOptions, ZeroTraffic, quantized_all_gather,
                                       quantized_reduce_scatter)
from fivefold.parallel.nvme_offload import NvmeOptimizer
from fivefold.parallel.shard_layout import GROUP_KINDS, ShardDegrees
from fivefold.parallel.zero_groups import ZeroGroups
from fivefold.plan.memory import ModelStateBytes, nvme_host_bytes, sharded_model_states, zero_model_states
from fivefold.reliability.activity import phase


@dataclass
class FlatGroup:
    """Parameters of one unit and one weight-decay class, as one padded flat vector split in N shards."""

    params: list[nn.Parameter]
    shapes: list[torch.Size]
    offsets: list[int]
    numel: int
    shard_numel: int  # this rank's optimizer piece: padded / o
    padded_numel: int
    piece_numel: int  # parameter piece: padded / p
    grad_numel: int  # gradient piece: padded / g
    decay: bool
    unit: int
    layout: GroupLayout
    flat: torch.Tensor | None = None  # stages 1-2: whole flat parameters (param dtype); params are views
    local: torch.Tensor | None = None  # stage 3: this rank's shard of the parameters (param dtype)
    master: nn.Parameter | None = None  # fp32 shard the optimizer steps
    flat_grad: torch.Tensor | None = None  # stage 1: whole flat gradient (param dtype); .grad are views
    grad_piece: torch.Tensor | None = None  # gradients sharded (g > 1): this rank's gradient piece, accumulated (param dtype)
    grad_shard: torch.Tensor | None = None  # this rank's reduced gradient of its optimizer piece (param dtype; a view)
    ready: int = 0  # gradients arrived since the last reduction
    reduced: bool = False  # reduced in the current backward pass
    pending: list = field(default_factory=list)
    norm_weights: torch.Tensor | None = None  # per element of this rank's shard: its weight in the norm
    host_grad: torch.Tensor | None = None  # offload from a GPU: the pinned host buffer the gradient shard lands in
    secondary: torch.Tensor | None = None  # hpZ: this rank's 1/h of the weights gathered in forward, for backward
    gathered: torch.Tensor | None = None  # stage 3: the whole weights, one tensor whose storage is released when freed

    def views(self, flat: torch.Tensor):
        for param, shape, offset in zip(self.params, self.shapes, self.offsets):
            yield param, flat[offset : offset + shape.numel()].view(shape)


def _make_group(layout: GroupLayout, params: list[nn.Parameter], degrees: ShardDegrees) -> FlatGroup:
    shard_numel = -(-layout.numel // degrees.optim)  # ceil: pad the flat vector to a multiple of the optimizer degree
    padded = shard_numel * degrees.optim
    return FlatGroup(params, list(layout.shapes), layout.offsets, layout.numel, shard_numel, padded,
                     padded // degrees.params, padded // degrees.grads, layout.decay, layout.unit, layout)


class ZeroDataParallel(SkipOnAccumulation):
    """Apply ZeRO stage 1, 2 or 3 to a model, from outside (the model's names and modules are kept)."""

    def __init__(
        self,
        model: nn.Module,
        sharding: ZeroGroups,
        stage: int,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        offload: bool = False,
        norm: GradNorm = GradNorm(),
        select: Callable[[str], bool] | None = None,
        zero_pp: ZeroPPGroups | None = None,
        swapped: bool = False,
    ):
        if stage not in (1, 2, 3):
            raise ConfigError(f"data_parallel.zero_stage = {stage}: ZeRO stages are 1, 2 or 3")
        self.model, self.stage, self.sharding = model, stage, sharding
        degrees = self.degrees = sharding.degrees
        self.sharded_params = degrees.params > 1  # ZeRO-3's path: gather before each unit's forward and backward
        self.reduces_every_micro_step = degrees.grads > 1  # whole gradients are kept and reduced once (ZeRO-1)
        self.shard_group, self.replicate_group = sharding.block, sharding.replica  # all pieces / their copies
        self.shards = degrees.optim
        # this rank's pieces: optimizer piece k of o, inside parameter piece a of p, inside gradient piece a(g/p)+b of g
        self.optim_index = degrees.optim_index(sharding.position)
        self.param_index, _, self.split_index = degrees.digits(sharding.position)
        self.optim_in_piece = self.optim_index - self.param_index * (degrees.optim // degrees.params)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.device = next(model.parameters()).device
        self.offload_device = torch.device("cpu") if offload else self.device
        self.offload = offload
        # NVMe offload: the masters and moments live in a file, stepped by parallel/nvme_offload.py
        self.swapped = swapped
        self.pinned = offload and not swapped and self.device.type == "cuda"
        # Other ranks holding other parts of the model (tensor-parallel pieces, pipeline stages) and
        # the weight each parameter's squares get (1 / copies), for the global gradient norm.
        self.norm = norm
        self.select = select  # which flat groups (by key) this instance owns; None: all
        self.zero_pp = zero_pp or ZeroPPGroups(ZeroPPOptions(), lambda group: False)
        if self.zero_pp.options.active and not (degrees.uniform and self.sharded_params):
            raise ConfigError(f"ZeRO++ (quantized_weights, hpz_partition, quantized_gradients) works on ZeRO stage 3 "
                              f"with one shard group, not {degrees.describe()}: set data_parallel.zero_stage = 3 and "
                              "leave shard_params / shard_grads / shard_optim at 0")
        self.traffic = ZeroTraffic()
        self._spans = {kind: self.zero_pp.spans_nodes(getattr(sharding, kind)) for kind in GROUP_KINDS}
        self._cross = self._spans["params"]
        self.hpz_size = dist.get_world_size(self.zero_pp.hpz) if self.zero_pp.hpz is not None else 1
        self.hpz_rank = dist.get_rank(self.zero_pp.hpz) if self.zero_pp.hpz is not None else 0
        self._broadcast_parameters()
        self.units = [block for _, block in units(model)]
        self.groups = self._build_groups()
        self._groups_of_unit: dict[int, list[FlatGroup]] = {}
        for g in self.groups:
            self._groups_of_unit.setdefault(g.unit, []).append(g)
        self._slot = {id(p): g for g in self.groups for p in g.params}
        self._gathered: dict[int, list] = {}  # unit -> pending all-gather works (stage 3)
        self._in_backward: set[int] = set()  # units whose backward has begun and whose weights are not yet freed
        for g in self.groups:
            g.norm_weights = self._norm_weights(g)
            self._shard_group(g)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for g in self.groups for p in g.params]
        if self.sharded_params:
            self._install_stage3_hooks()

    # ----------------------------------------------------------------- set-up
    def _layouts(self) -> list[GroupLayout]:
        return [g for g in flat_group_layout(self.model) if self.select is None or self.select(g.key)]

    def _broadcast_parameters(self) -> None:
        params = dict(self.model.named_parameters())
        mine = [params[n] for g in self._layouts() for n in g.names]
        for group in (self.shard_group, self.replicate_group):  # the block's rank 0, then across the blocks
            if group is not None:
                broadcast_module(self.model, group, mine)

    def _build_groups(self) -> list[FlatGroup]:
        params = dict(self.model.named_parameters())
        return [_make_group(layout, [params[n] for n in layout.names], self.degrees) for layout in self._layouts()]

    @torch.no_grad()
    def _shard_group(self, g: FlatGroup) -> None:
        flat = torch.zeros(g.padded_numel, dtype=self.param_dtype, device=self.device)
        for param, view in g.views(flat):
            view.copy_(param.data)
        if self.sharded_params:
            g.local = flat[self.param_index * g.piece_numel : (self.param_index + 1) * g.piece_numel].clone()
            for param, _ in g.views(flat):
                param.data = torch.empty(0, dtype=self.param_dtype, device=self.device)
        else:
            g.flat = flat
            for param, view in g.views(flat):
                param.data = view
        own = self.compute_shard(g)
        aliased = self.param_dtype == torch.float32 and not self.offload
        if self.swapped:
            pass  # the NvmeOptimizer takes the initial masters from compute_shard(g)
        elif self.pinned:  # page-locked host memory: copies to and from the GPU run asynchronously, at full speed
            g.master = nn.Parameter(torch.empty(own.shape, dtype=torch.float32, pin_memory=True).copy_(own))
            g.host_grad = torch.empty(own.shape, dtype=torch.float32, pin_memory=True)
        else:
            g.master = nn.Parameter(own if aliased else own.to(self.offload_device, torch.float32, copy=True))
        if not self.reduces_every_micro_step:
            g.flat_grad = torch.zeros(g.padded_numel, dtype=self.param_dtype, device=self.device)
            for param, view in g.views(g.flat_grad):
                param.grad = view

    def _norm_weights(self, g: FlatGroup) -> torch.Tensor | None:
        """Per-element weight of this rank's shard in the norm, so values held by several ranks count once."""
        if self.norm.weight is None:
            return None
        full = torch.zeros(g.padded_numel, dtype=torch.float32, device=self.device)  # 1 / replicas, within 3e-8
        for param, shape, offset in zip(g.params, g.shapes, g.offsets):
            full[offset : offset + shape.numel()] = self.norm.weight(param)
        return full[self.optim_index * g.shard_numel : (self.optim_index + 1) * g.shard_numel].clone()

    def master_parameters(self, decay: bool) -> list[nn.Parameter]:
        return [g.master for g in self.groups if g.decay == decay and g.master is not None]

    def compute_shard(self, g: FlatGroup) -> torch.Tensor:
        """This rank's optimizer piece of the group's compute weights (padded; the weights the next forward uses)."""
        if self.sharded_params:
            return g.local[self.optim_in_piece * g.shard_numel : (self.optim_in_piece + 1) * g.shard_numel]
        return g.flat[self.optim_index * g.shard_numel : (self.optim_index + 1) * g.shard_numel]

    # ------------------------------------------------------ stage 3 gathering
    def _install_stage3_hooks(self) -> None:
        root = len(self.units)
        self._hooks.append(self.model.register_forward_pre_hook(lambda module, args: self._gather(root, wait=True)))
        for index, unit in enumerate(self.units):
            self._hooks += [unit.register_forward_pre_hook(self._pre_forward(index)),
                            unit.register_forward_hook(lambda module, args, out, index=index: self._after_forward(index)),
                            unit.register_full_backward_pre_hook(self._pre_backward(index))]

    def remove(self) -> None:
        """Detach every hook this instance put on the model's parameters and modules (the sync's close)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _pre_forward(self, index: int):
        def hook(module, args):
            self._gather(index, wait=True)
            if index + 1 < len(self.units):
                self._gather(index + 1, wait=False)  # prefetch the next block
        return hook

    def _pre_backward(self, index: int):
        def hook(module, grad_output):
            self._in_backward.add(index)
            self._gather(index, wait=True, backward=True)
            if index > 0:
                self._gather(index - 1, wait=False, backward=True)  # backward runs blocks in reverse
        return hook

    @torch.no_grad()
    def _gather(self, unit: int, wait: bool, backward: bool = False) -> None:
        if unit not in self._gathered:
            works = []
            name = "backward all-gather" if backward else "forward all-gather"
            for g in self._groups_of_unit.get(unit, []):
                full = self._gather_buffer(g)
                works.append(self._gather_group(g, full, name))
                for param, view in g.views(full):
                    param.data = view
            self._gathered[unit] = works
        if wait:
            with phase(f"ZeRO-3 all-gather of unit {unit}", comm=True):
                for work in self._gathered[unit]:
                    work.wait()
            self._gathered[unit] = []

    def _gather_buffer(self, g: FlatGroup) -> torch.Tensor:
        """The group's gathered weights: one tensor for the whole run, its storage released when the unit is freed
        and grown again for the next gather (FSDP's way). The weights a matmul saves for backward are views of
        it, so freeing really returns the memory, and backward sees them gathered again."""
        if g.gathered is None:
            g.gathered = torch.empty(g.padded_numel, dtype=self.param_dtype, device=self.device)
        storage = g.gathered.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(g.padded_numel * g.gathered.element_size())
        return g.gathered

    def holds_gathered(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in one of the stage-3 gathered buffers now held (a weight a matmul saved)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(g.gathered is not None and g.gathered.untyped_storage().nbytes() > 0
                   and g.gathered.untyped_storage().data_ptr() == ptr for g in self.groups)

    def _gather_group(self, g: FlatGroup, full: torch.Tensor, name: str):
        """Start gathering one flat group into `full`: from the hpZ secondary shards within the node when
        this backward has them, else from the primary shards (int8 under qwZ)."""
        pp = self.zero_pp
        traffic = self.traffic if self.model.training else ZeroTraffic()  # evaluation's gathers are not a step's
        if g.secondary is not None and name == "backward all-gather":
            traffic.add(name, pp.spans_nodes(pp.hpz), pp.hpz, full.numel() * full.element_size())
            return all_gather_flat(full, g.secondary, group=pp.hpz, async_op=True)
        if pp.options.quantized_weights:
            return quantized_all_gather(full, g.local, self.sharding.params, pp.options.block, traffic, name, self._cross)
        traffic.add(name, self._cross, self.sharding.params, full.numel() * full.element_size())
        return all_gather_flat(full, g.local, group=self.sharding.params, async_op=True)

    def _after_forward(self, unit: int) -> None:
        """hpZ: keep this rank's 1/h of the gathered weights for the backward gather; then free them.
        (Only in a forward that will have a backward: not in evaluation or generation.) A forward that
        recomputation runs inside the unit's backward keeps them: the reduction frees them after that backward."""
        if unit in self._in_backward:
            return
        if self.hpz_size > 1 and torch.is_grad_enabled():
            self._wait_gathered(unit)
            with torch.no_grad():
                for g in self._groups_of_unit.get(unit, []):
                    part = g.padded_numel // self.hpz_size
                    full = torch.empty(g.padded_numel, dtype=self.param_dtype, device=self.device)
                    for param, view in g.views(full):
                        view.copy_(param.data)
                    g.secondary = full[self.hpz_rank * part : (self.hpz_rank + 1) * part].clone()
        self._free(unit)

    def _wait_gathered(self, unit: int) -> None:
        with phase(f"ZeRO-3 all-gather of unit {unit}", comm=True):
            for work in self._gathered.pop(unit, None) or []:
                work.wait()

    def _free(self, unit: int) -> None:
        self._wait_gathered(unit)
        self._in_backward.discard(unit)
        for g in self._groups_of_unit.get(unit, []):
            for param in g.params:
                param.data = torch.empty(0, dtype=self.param_dtype, device=self.device)
            if g.gathered is not None:
                g.gathered.untyped_storage().resize_(0)

    # ------------------------------------------------------ gradient reduction
    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        g = self._slot[id(param)]
        g.ready += 1
        if g.ready == len(g.params):
            self._reduce(g)

    @torch.no_grad()
    def _reduce(self, g: FlatGroup) -> None:
        """Start reducing a group's gradient: whole gradients (ZeRO-1) straight into this rank's optimizer
        piece over the block; sharded gradients into its gradient piece over the gradient group."""
        g.ready, g.reduced = 0, True
        if not self.reduces_every_micro_step:
            g.pending.append(self._reduce_scatter("optimizer reduce-scatter", g.flat_grad.to(self.reduce_dtype),
                                                  g.shard_numel, "split"))
            return
        full = torch.zeros(g.padded_numel, dtype=self.reduce_dtype, device=self.device)
        for param, view in g.views(full):
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = None  # the full gradient is not kept (gradients sharded)
        if self.zero_pp.options.gradient_bits:
            out = torch.empty(g.grad_numel, dtype=self.reduce_dtype, device=self.device)
            g.pending.append((quantized_reduce_scatter(out, full, self.zero_pp, self.traffic), out))
        else:
            if self.degrees.grad_permuted:  # rank j = b p + a of the gradient group receives natural piece a (g/p) + b
                p = self.degrees.params
                full = full.view(p, self.degrees.grads // p, -1).transpose(0, 1).reshape(-1)
            g.pending.append(self._reduce_scatter("reduce-scatter", full, g.grad_numel, "grads"))
        unit_groups = self._groups_of_unit[g.unit]
        if self.sharded_params and g.unit < len(self.units) and all(x.reduced for x in unit_groups):
            self._free(g.unit)  # this block's backward is done: drop its gathered weights
            for x in unit_groups:
                x.reduced, x.secondary = False, None

    def _reduce_scatter(self, name: str, full: torch.Tensor, numel: int, kind: str) -> tuple:
        """(work or None, output): reduce-scatter `full` over the `kind` group into `numel` elements (the whole of
        `full` when the group has one rank)."""
        group = getattr(self.sharding, kind)
        if group is None:
            return None, full
        out = torch.empty(numel, dtype=full.dtype, device=self.device)
        self.traffic.add(name, self._spans[kind], group, full.numel() * full.element_size())
        return reduce_scatter_flat(out, full, group=group, async_op=True), out

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Reduce what is left, wait for every reduction, and leave each group's reduced optimizer piece in grad_shard.

        A group only some of whose parameters got gradients is reduced here; a group that got none
        (unused on every rank alike) is reduced too when gradients are whole and counts as zero when
        they are sharded. Sharded gradient pieces are then reduce-scattered into optimizer pieces over
        the split group, and every optimizer piece all-reduced over its replicas.
        """
        whole = not self.reduces_every_micro_step
        for g in self.groups:
            if g.ready > 0 or (whole and not g.pending):
                self._reduce(g)
        for index, g in enumerate(self.groups):
            for work, out in g.pending:
                if work is not None:
                    with phase(f"ZeRO-{self.stage} reduce-scatter of group {index + 1}/{len(self.groups)}", comm=True):
                        work.wait()
                if whole:
                    g.grad_shard = self._optimizer_piece(g.flat_grad, g)
                    g.grad_shard.copy_(out)
                elif g.grad_piece is None:
                    g.grad_piece = out.to(self.param_dtype)
                else:
                    g.grad_piece += out.to(self.param_dtype)
            g.pending, g.ready, g.reduced = [], 0, False
            if not whole and g.grad_piece is None:
                g.grad_piece = torch.zeros(g.grad_numel, dtype=self.param_dtype, device=self.device)
        if not whole:
            splits = [(g, self._reduce_scatter("optimizer reduce-scatter", g.grad_piece.to(self.reduce_dtype),
                                               g.shard_numel, "split")) for g in self.groups]
            for g, (work, out) in splits:
                if work is not None:
                    with phase("ZeRO optimizer reduce-scatter", comm=True):
                        work.wait()
                part = self.split_index * g.shard_numel
                g.grad_shard = g.grad_piece[part : part + g.shard_numel]
                g.grad_shard.copy_(out)
        if self.replicate_group is not None:
            for g in self.groups:
                reduced = g.grad_shard.to(self.reduce_dtype)
                self.traffic.add("replica all-reduce", self._spans["replica"], self.replicate_group,
                                 reduced.numel() * reduced.element_size(), True)
                with phase("ZeRO replica all-reduce", comm=True):
                    dist.all_reduce(reduced, group=self.replicate_group)
                g.grad_shard.copy_(reduced)
        if self.sharded_params:
            self._free(len(self.units))

    def _optimizer_piece(self, flat: torch.Tensor, g: FlatGroup) -> torch.Tensor:
        """This rank's optimizer piece of a whole (padded) flat vector."""
        return flat[self.optim_index * g.shard_numel : (self.optim_index + 1) * g.shard_numel]

    # ---------------------------------------------------------------- the step
    def local_squares(self) -> float:
        """This rank's shards' weighted sum of squared gradients."""
        weighted = [(g.grad_shard.float().square() * g.norm_weights).sum() for g in self.groups if g.norm_weights is not None]
        return sum_of_squares([g.grad_shard for g in self.groups if g.norm_weights is None]) + \
            (float(torch.stack(weighted).double().sum()) if weighted else 0.0)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm of the gradient from the shards; scale the shards if it exceeds max_norm."""
        norm = self.norm.total(self.local_squares(), self.device, extra=(self.shard_group,))  # shards, then the parts
        clip_([g.grad_shard for g in self.groups], norm, max_norm)
        return norm

    def prepare_step(self) -> None:
        """Hand the gradient shards to the fp32 masters (on the offload device). (NVMe offload takes each
        shard during its pipelined step instead.)"""
        if self.swapped:
            return
        for g in self.groups:
            if self.pinned:
                g.master.grad = g.host_grad.copy_(g.grad_shard, non_blocking=True)
            else:
                g.master.grad = g.grad_shard.to(self.offload_device, torch.float32)
        if self.pinned:
            torch.cuda.synchronize(self.device)  # every shard's copy has landed before the CPU optimizer reads it

    @torch.no_grad()
    def after_step(self) -> None:
        """Bring updated masters back to the compute weights; drop gradients."""
        for g in self.groups:
            if g.master is not None:
                g.master.grad = None
            if g.flat_grad is not None:
                g.flat_grad.zero_()
            g.grad_shard = g.grad_piece = None
        self.publish_masters()

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Copy each fp32 master shard into the compute weights, and all-gather the optimizer pieces of this rank's
        parameter piece over the publish group (the whole flat vector when parameters are whole). Under NVMe
        offload the step has already written the compute shard."""
        if self.sharded_params:
            for unit in range(len(self.units) + 1):
                self._free(unit)  # gathered copies (e.g. kept by evaluation) are stale now
        group = self.sharding.publish
        for g in self.groups:
            g.secondary = None
            mine = self.compute_shard(g)
            if g.master is not None and mine.data_ptr() != g.master.data_ptr():
                mine.copy_(g.master, non_blocking=self.pinned)
            if group is None:
                continue
            piece = g.local if self.sharded_params else g.flat
            self.traffic.add("parameter all-gather", self._spans["publish"], group, piece.numel() * piece.element_size())
            if not self.degrees.publish_permuted:
                all_gather_flat(piece, mine.clone(), group=group)
                continue
            # pieces arrive in publish-group order (c, b); within the parameter piece they lie in order (b, c)
            gathered = torch.empty_like(piece)
            all_gather_flat(gathered, mine.clone(), group=group)
            d = self.degrees
            piece.copy_(gathered.view(d.optim // d.grads, d.grads // d.params, -1).transpose(0, 1).reshape(-1))

    def owned_range(self, g: FlatGroup) -> tuple[int, int]:
        """[lo, hi) of the group's unpadded flat vector held in this rank's optimizer piece (empty past the end)."""
        lo = min(self.optim_index * g.shard_numel, g.numel)
        return lo, min(lo + g.shard_numel, g.numel)

    def zero_grad(self) -> None:
        for g in self.groups:
            if g.flat_grad is not None:
                g.flat_grad.zero_()


class ZeroSync(GradientSync):
    """ZeRO as a GradientSync: AdamW over this rank's fp32 master shards; checkpoints written shard by shard.

    Checkpoint tensors are DTensors over (dp_replicate, dp_shard x cp) wrapping this rank's unpadded
    shard of every flat group, so DCP writes the shards in parallel with no gather and reads back
    whatever another layout's shards cover. Routed experts (mixture-of-experts) are a second ZeRO
    instance, `experts`, sharded over their expert-data-parallel group (a 1-D mesh of its own).
    """

    kind = "zero"
    collective_checkpoint = True

    def __init__(self, zero: ZeroDataParallel, optimizer: torch.optim.Optimizer, norm: GradNorm, device_mesh,
                 tied_group: dist.ProcessGroup | None = None, loss_group: dist.ProcessGroup | None = None,
                 experts: tuple[ZeroDataParallel, object] | None = None):
        super().__init__(zero.model, norm, tied_group, loss_group)
        self.zero, self.optimizer, self.device_mesh = zero, optimizer, device_mesh
        self.nvme = optimizer if isinstance(optimizer, NvmeOptimizer) else None
        self._swapped = {id(g): index for index, (_, g) in enumerate(self.nvme.pairs)} if self.nvme else {}
        self.gathers_in_forward = zero.sharded_params
        self.parts = [(zero, device_mesh, [Replicate(), Shard(0)])]
        if experts is not None:
            self.parts.append((experts[0], experts[1], [Shard(0)]))

    @property
    def zeros(self) -> list[ZeroDataParallel]:
        return [z for z, _, _ in self.parts]

    def no_sync(self):
        stack = contextlib.ExitStack()
        for z in self.zeros:
            stack.enter_context(z.no_sync())
        return stack

    def _finish(self) -> None:
        for z in self.zeros:
            z.finish_gradient_sync()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        if len(self.parts) == 1:
            return self.zero.clip_grad_norm_(max_norm)
        experts = self.zeros[1]
        norm = self.norm.total(self.zero.local_squares(), self.zero.device, extra=(self.zero.shard_group,),
                               expert_squares=experts.local_squares(), expert_extra=(experts.shard_group,))
        clip_([g.grad_shard for z in self.zeros for g in z.groups], norm, max_norm)
        return norm

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        for z in self.zeros:
            z.prepare_step()
        self.optimizer.step()

    def after_step(self) -> None:
        for z in self.zeros:
            z.after_step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """NVMe offload: remove this rank's swap file (its states are in the last checkpoint); then the hooks."""
        if self.nvme:
            self.nvme.close()
        super().close()

    def remove(self) -> None:
        for z in self.zeros:
            z.remove()

    def traffic_metrics(self) -> dict[str, int]:
        """zero_bytes: what this rank sent in ZeRO's collectives since the last call (ring volume, see ZeroTraffic);
        zero_cross_node_bytes: the part sent in groups that span nodes (gradient_comm.node_size)."""
        counts = self.zero.traffic.take()
        return {"zero_bytes": sum(counts.values()), "zero_cross_node_bytes": sum(ZeroTraffic.cross_node(counts).values())}

    @property
    def mixed_precision(self) -> bool:
        return self.zero.param_dtype != torch.float32

    def describe(self) -> str:
        z = self.zero
        experts = "" if len(self.parts) == 1 else f" (experts over {self.zeros[1].shards} ranks of their EDP group)"
        d = z.degrees
        replicas = f" x {d.replicas} replicas" if d.replicas > 1 else ""
        kind = f"ZeRO-{z.stage} over {z.shards} ranks{replicas}" if d.matches_stage(z.stage) else f"ZeRO ({d.describe()})"
        return (f"{kind}{experts}, {sum(len(x.groups) for x in self.zeros)} flat groups"
                f"{', bf16 weights + fp32 masters' if self.mixed_precision else ''}"
                f"{f', optimizer states on NVMe ({self.nvme.path})' if self.nvme else ', offloaded to CPU' if z.offload else ''}")

    def expected_model_states(self, parameters: int) -> ModelStateBytes:
        """The ZeRO formula for the dense parameters over the data-parallel shards, plus (MoE) the routed
        experts' over their expert-data-parallel shards."""
        experts = sum(g.numel for z in self.zeros[1:] for g in z.groups)
        d = self.zero.degrees
        dense = sharded_model_states(parameters - experts, d.params, d.grads, d.optim, self.mixed_precision,
                                     self.zero.offload)
        if experts:
            routed = zero_model_states(experts, self.zero.stage, self.zeros[1].shards, self.mixed_precision,
                                       self.zero.offload)
            dense = ModelStateBytes(dense.parameters + routed.parameters, dense.gradients + routed.gradients,
                                    dense.optimizer + routed.optimizer)
        if self.nvme:  # host memory keeps the slot ring; the states themselves are in the file
            return ModelStateBytes(dense.parameters, dense.gradients,
                                   nvme_host_bytes([g.shard_numel for z in self.zeros for g in z.groups],
                                                   self.nvme.piece_numel))
        return dense

    def model_state_tensors(self) -> tuple[list, list, list]:
        groups = [g for z in self.zeros for g in z.groups]
        params = [g.flat for g in groups] + [g.local for g in groups] + list(self.model.parameters())
        grads = [g.flat_grad for g in groups] + [g.grad_shard for g in groups]
        if self.nvme:  # in host memory: the slot ring only (the states are in the swap file)
            return params, grads, self.nvme.host_tensors()
        masters = [p for group in self.optimizer.param_groups for p in group["params"]]
        transient = {id(p.grad) for p in masters}  # the fp32 gradient copy handed to the optimizer
        states = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return params, grads, [t for t in [*states, *masters] if id(t) not in transient]

    def state_dict(self, ranks: PieceRanks, fresh: bool = False) -> dict[str, torch.Tensor]:
        """This rank's unpadded shard of every group as DTensors; with `fresh`, zero buffers for DCP to load into."""
        out = {}
        for z, mesh, placements in self.parts:
            for g in z.groups:
                lo, hi = z.owned_range(g)
                n = hi - lo
                key = ranks.key(g.layout.key)
                if self.nvme:
                    swapped, step = ({}, 0.0) if fresh else self.nvme.load(self._swapped[id(g)])
                    state = {**swapped, "step": step}
                    master = swapped.get("master")
                else:
                    state, master = self.optimizer.state.get(g.master, {}), g.master.detach()
                locals_ = {"model": None if fresh else master[:n]}
                for moment in MOMENTS:
                    locals_[moment] = state[moment][:n] if moment in state else torch.zeros(n)
                for kind, local in locals_.items():
                    local = torch.zeros(n, dtype=torch.float32, device=z.device) if fresh else local.to(z.device)
                    out[key.tensor(kind)] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                               shape=(g.numel,), stride=(1,))
                out[key.tensor("step")] = step_tensor(0.0 if fresh else float(state.get("step", 0.0)))
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], ranks: PieceRanks) -> None:
        for z in self.zeros:
            for g in z.groups:
                key = ranks.key(g.layout.key)
                self._set_shard(g, {kind: state[key.tensor(kind)].to_local() for kind in ("model", *MOMENTS)},
                                state[key.tensor("step")])
            z.publish_masters()

    @torch.no_grad()
    def load_pieces(self, pieces: dict[str, dict[str, torch.Tensor]]) -> None:
        for z in self.zeros:
            for g in z.groups:
                lo, hi = z.owned_range(g)
                piece = pieces[g.layout.key]
                self._set_shard(g, {kind: piece[kind][lo:hi] for kind in ("model", *MOMENTS)}, piece["step"])
            z.publish_masters()

    def _set_shard(self, g: FlatGroup, values: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        n = values["model"].numel()

        def padded(value: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(g.shard_numel, dtype=torch.float32) if g.master is None else torch.zeros_like(g.master)
            out[:n] = value.to(out.device)
            return out

        if self.nvme:
            self.nvme.store(self._swapped[id(g)], {"master": padded(values["model"]),
                                                   **{m: padded(values[m]) for m in MOMENTS}}, float(step))
            return
        g.master.copy_(padded(values["model"]))
        self.optimizer.state[g.master] = {"step": step_tensor(step, self.optimizer, g.master),
                                          **{m: padded(values[m]) for m in MOMENTS}}
