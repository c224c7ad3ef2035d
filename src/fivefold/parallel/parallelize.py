"""`parallelize(model, mesh, config)`: apply the model-parallel folds to a plain, materialised model.

Order: tensor (and sequence) parallelism swaps the layers and slices the weights, context
parallelism replaces the attention cores, then activation recomputation wraps blocks or
attention cores (so a recomputed core reruns its context-parallel communication too). Data parallelism (our DDP or ZeRO)
is applied after this by the trainer, over the data-parallel groups of the same mesh. The
result says how to compute the loss: with tensor parallelism the logits are split over the
vocabulary, so the loss is the vocab-parallel cross-entropy; with context parallelism each rank
feeds the model its shard of every sequence, with those tokens' positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.config import ParallelConfig
from fivefold.parallel.context_parallel import (
    ContextParallelLayout,
    apply_context_parallel,
    build_context_parallel_groups,
)
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.tensor_parallel import apply_tensor_parallel, tp_spec, vocab_parallel_cross_entropy

IGNORE_INDEX = -100


@dataclass
class Parallelized:
    """What the trainer needs to know about a parallelized model."""

    vocab_size: int
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp: int = 1
    cp_layout: ContextParallelLayout | None = None
    cp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    duplicates: frozenset[int] = frozenset()  # ids of parameters another pipeline stage also holds (tied head)

    @property
    def norm_groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Groups whose ranks hold the other parts of the model: the gradient norm is summed over them."""
        return tuple(g for g in (self.tp_group, self.pp_group) if g is not None)

    def shard_sequence(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This rank's (inputs, labels, positions) of a (batch, seq) micro-batch; positions None without CP."""
        if self.cp_layout is None:
            return inputs, labels, None
        positions = self.cp_layout.shard_positions(inputs.shape[1], self.cp_rank).to(inputs.device)
        return inputs[:, positions], labels[:, positions], positions

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum (not mean) of the token cross-entropies, in fp32."""
        if self.tp_group is None:
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_size, self.tp_group, IGNORE_INDEX).sum()

    def replicas(self, param: nn.Parameter) -> int:
        """How many tensor-parallel ranks hold this parameter's values (1 when fully split)."""
        spec = tp_spec(param)
        return self.tp if spec is None else spec.replicas(self.tp)

    def norm_weight(self, param: nn.Parameter) -> float:
        """Weight of this rank's copy of `param` in the global norm: each value counts once over all ranks."""
        return 0.0 if id(param) in self.duplicates else 1.0 / self.replicas(param)

    @torch.no_grad()
    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Global L2 gradient norm over the tensor-parallel and pipeline groups (each value counted once); clip."""
        if not self.norm_groups:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        pairs = [(p, p.grad) for p in params if p.grad is not None]
        grads = [g for _, g in pairs]
        local = sum(float(g.double().pow(2).sum()) * self.norm_weight(p) for p, g in pairs)
        total = torch.tensor(local, dtype=torch.float64, device=self.device_of(params))
        for group in self.norm_groups:
            dist.all_reduce(total, group=group)
        norm = float(total.sqrt())
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm


    @staticmethod
    def device_of(params: list[nn.Parameter]) -> torch.device:
        return params[0].device if params else torch.device("cpu")


def parallelize(model: nn.Module, mesh: Mesh | None, config: ParallelConfig) -> Parallelized:
    """Apply tensor/sequence/context parallelism and recomputation in place; return how to use the result."""
    result = Parallelized(vocab_size=model.config.vocab_size)
    if config.tp > 1:
        group = mesh.group("tp")
        apply_tensor_parallel(model, group, config.sequence_parallel)
        result.tp_group, result.tp_rank, result.tp = group, dist.get_rank(group), config.tp
    if config.cp > 1:
        layout = ContextParallelLayout.for_method(config.cp_method, config.cp, config.cp_heads)
        groups = build_context_parallel_groups(mesh.rank_table("cp"), layout)
        apply_context_parallel(model, groups)
        result.cp_layout, result.cp_rank = layout, groups.cp_rank
    apply_recompute(model, config.recompute)
    return result
