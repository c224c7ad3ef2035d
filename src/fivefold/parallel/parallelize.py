"""`parallelize(model, mesh, config, device)`: apply every fold to a plain meta-device model, in one place.

The order (torchtitan's parallelize_llama, with the pipeline cut first as Megatron does):
  1. pipeline: split the blocks into stages and delete what this rank's stages do not run,
     before any memory is allocated (parameter names stay global);
  2. materialise the kept weights on the device (same seed, same values as one process), or read
     them from the Hugging Face folder of model.init_from_hf (only the tensors this rank's stages hold);
  3. tensor (and sequence) parallelism swaps the layers and slices the weights;
  4. context parallelism replaces the attention cores; expert parallelism (cut before materialising,
     like the pipeline) gets its all-to-all dispatch and every MoE layer its routing groups;
  5. activation recomputation wraps blocks or attention cores (so a recomputed core reruns its
     context-parallel communication too);
  6. data parallelism: `apply_data_parallel` picks the GradientSync (DDP with its reducer and
     schedule, ZeRO-1/2/3, or a parameter-server worker) over the mesh's data-parallel groups;
  7. the step function is chosen once: one stage, or the pipeline schedule's executor.
The result is frozen: the training loop reads it and never branches on which folds are on.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fivefold.comm.reducers import build_reducer
from fivefold.config import ContextParallelConfig, JobConfig, TensorParallelConfig
from fivefold.model import Transformer, materialize
from fivefold.model.hf import load_hf_weights
from fivefold.optim import build_adamw, build_optimizer
from fivefold.parallel.checkpoint_layout import CheckpointLayout, PieceRanks, local_layout
from fivefold.ops.fp8 import apply_fp8
from fivefold.parallel.compile import apply_compile, compiled_loss
from fivefold.parallel.comm_schedule import PriorityDataParallel, PrioritySync
from fivefold.parallel.context_parallel import ContextParallelLayout, apply_context_parallel, build_context_parallel_groups
from fivefold.errors import ConfigError
from fivefold.parallel.data_parallel import DataParallel, DDPSync
from fivefold.parallel.expert_placement import placements_for
from fivefold.parallel.flat_groups import is_expert_group
from fivefold.parallel.expert_parallel import (
    AllToAllMeter,
    ExpertGroups,
    ReplicaGradients,
    apply_expert_parallel,
    apply_routing_groups,
    build_expert_groups,
    cut_experts,
    is_expert_parameter,
    shard_experts,
)
from fivefold.parallel.gradient_sync import GradientSync, GradNorm
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.nvme_offload import NvmeOptimizer
from fivefold.parallel.parameter_server import ParameterServerSync, ServerClient, ServerLayout
from fivefold.parallel.pipeline.executor import PipelineExecutor
from fivefold.parallel.pipeline.schedules import PipelineShape
from fivefold.parallel.pipeline.stages import (
    PipelineStage,
    check_pipeline,
    cut_model,
    holds_tied_copy,
    stages_of_rank,
    tied_embedding_rows,
)
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.step import PipelineStep, SingleStageStep
from fivefold.parallel.output_loss import OutputLoss, cross_entropy_sum
from fivefold.parallel.tensor_parallel import IGNORE_INDEX, apply_tensor_parallel, tp_spec, vocab_parallel_cross_entropy
from fivefold.parallel.shard_layout import config_degrees
from fivefold.parallel.zero import ZeroDataParallel, ZeroSync
from fivefold.parallel.zero_groups import ZeroGroups, build_zero_groups, checkpoint_mesh
from fivefold.parallel.zero_pp import ZeroPPOptions, build_zero_pp_groups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelParallel:
    """What tensor, context and pipeline parallelism change for the loop: batch sharding, loss, norm weights."""

    vocab_size: int
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp: int = 1
    cp_layout: ContextParallelLayout | None = None
    cp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    duplicates: frozenset[int] = frozenset()  # ids of parameters another pipeline stage also holds (tied head)

    def shard_sequence(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This rank's (inputs, labels, positions) of a (batch, seq) micro-batch; positions None without CP."""
        if self.cp_layout is None:
            return inputs, labels, None
        positions = self.cp_layout.shard_positions(inputs.shape[1], self.cp_rank).to(inputs.device)
        return inputs[:, positions], labels[:, positions], positions

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum (not mean) of the token cross-entropies, in fp32."""
        if self.tp_group is None:
            return cross_entropy_sum(logits, labels)
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_size, self.tp_group, IGNORE_INDEX).sum()

    def replicas(self, param: nn.Parameter) -> int:
        """How many tensor-parallel ranks hold this parameter's values (1 when fully split)."""
        spec = tp_spec(param)
        return self.tp if spec is None else spec.replicas(self.tp)

    def norm_weight(self, param: nn.Parameter) -> float:
        """Weight of this rank's copy of `param` in the global norm: each value counts once over all ranks."""
        return 0.0 if id(param) in self.duplicates else 1.0 / self.replicas(param)

    def grad_norm(self) -> GradNorm:
        groups = tuple(g for g in (self.tp_group, self.pp_group) if g is not None)
        return GradNorm(groups, self.norm_weight if groups or self.duplicates else None)

    @property
    def checkpoint_tp_rank(self) -> int | None:
        return self.tp_rank if self.tp > 1 else None

    def piece_ranks(self, experts: ExpertGroups | None) -> PieceRanks:
        """Which checkpoint piece of each group this rank holds (TP rank for dense groups, ETP rank for experts)."""
        return PieceRanks(self.checkpoint_tp_rank, experts.etp_rank if experts is not None and experts.etp > 1 else None)


@dataclass(frozen=True)
class Parallelized:
    """This rank's part of the model with every fold applied, its gradient sync and its step function."""

    model: Transformer
    folds: ModelParallel
    sync: GradientSync
    step: SingleStageStep | PipelineStep
    stage_split: tuple[tuple[int, ...], ...] | None  # blocks of every pipeline stage (None without pipelining)
    layout: CheckpointLayout  # every rank's checkpoint pieces (gathered over TP and pipeline ranks)
    local_layout: CheckpointLayout  # this rank's pieces
    parameters: int  # Ψ on this rank: its tensor-parallel shard and pipeline stages, before ZeRO
    dp_rank: int  # which slice of each global batch this rank takes
    experts: ExpertGroups | None = None  # expert-parallel groups (models with routed experts)
    alltoall: AllToAllMeter | None = None  # time and bytes of the expert dispatch

    @property
    def piece_ranks(self) -> PieceRanks:
        return self.folds.piece_ranks(self.experts)


def apply_model_parallel(model: Transformer, mesh: Mesh, tensor: TensorParallelConfig = TensorParallelConfig(),
                         context: ContextParallelConfig = ContextParallelConfig(), recompute: str = "none",
                         stages: list[PipelineStage] | None = None) -> ModelParallel:
    """Tensor/sequence parallelism, context parallelism and recomputation on a materialised model, in place."""
    folds = {"vocab_size": model.config.vocab_size, "pp_group": mesh.group("pp")}
    tp_group = mesh.group("tp")
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group, tensor.sequence_parallel, tensor.comm_overlap)
        folds.update(tp_group=tp_group, tp_rank=dist.get_rank(tp_group), tp=tensor.degree)
    if context.degree > 1:
        layout = ContextParallelLayout.for_method(context.method, context.degree, context.heads, context.inner_ring,
                                                  context.placement)
        groups = build_context_parallel_groups(mesh, layout)
        apply_context_parallel(model, groups)
        folds.update(cp_layout=layout, cp_rank=groups.cp_rank)
    apply_recompute(model, recompute)
    if stages is not None and holds_tied_copy(model, stages):
        folds["duplicates"] = frozenset({id(model.tok_embeddings.weight)})
    return ModelParallel(**folds)


def zero_pp_options(config: JobConfig) -> ZeroPPOptions:
    """The ZeRO++ switches of a config, with its node size resolved (gradient_comm.node_size, else torchrun's)."""
    dp = config.data_parallel
    node_size = config.gradient_comm.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    return ZeroPPOptions(dp.quantized_weights, dp.hpz_partition, dp.gradient_bits, dp.quantization_block, node_size)


def apply_data_parallel(model: Transformer, mesh: Mesh, config: JobConfig, norm: GradNorm,
                        tied_group: dist.ProcessGroup | None = None, experts: ExpertGroups | None = None,
                        replicas: Callable[[], None] | None = None) -> GradientSync:
    """The gradient sync for this run: a parameter-server worker, ZeRO, or DDP (FIFO or priority).

    With routed experts, their gradients are summed over their expert-data-parallel group, the
    other parameters' over the data-parallel group as usual.
    """
    dp, comm, loss_group = config.data_parallel, config.gradient_comm, mesh.group("dp_cp")
    if dp.mode == "ps":
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        layout = ServerLayout.balance(sizes, mesh.dims.world_size, config.parameter_server.servers)
        return ParameterServerSync(model, ServerClient(model, layout), config.parameter_server.sync, mesh.group("workers"))
    reduce_dtype = DTYPES[comm.reduce_dtype]
    if dp.zero_stage > 0:
        moe = experts is not None
        degrees = config_degrees(config, mesh.dims)
        sharding = build_zero_groups(mesh, degrees)
        zero_pp = build_zero_pp_groups(zero_pp_options(config), sharding.block_rows, mesh.subgroup)
        zero = ZeroDataParallel(model, sharding, dp.zero_stage,
                                DTYPES[dp.param_dtype], reduce_dtype, dp.offload, norm=norm,
                                select=(lambda key: not is_expert_group(key)) if moe else None, zero_pp=zero_pp,
                                swapped=bool(dp.nvme_path))
        parts = [zero]
        expert_part = None
        if moe:
            if experts.edp_group is None:
                raise ConfigError(
                    f"data_parallel.zero_stage = {dp.zero_stage} shards the experts over their expert-data-parallel group, "
                    f"but expert_parallel.degree x tensor = {config.expert_parallel.degree} x {config.expert_parallel.tensor} "
                    "leaves each expert piece on one rank: lower the expert degrees or raise the data-parallel degree")
            expert_zero = ZeroDataParallel(model, ZeroGroups.over(experts.edp_group, None, dp.zero_stage), dp.zero_stage,
                                           DTYPES[dp.param_dtype],
                                           reduce_dtype, dp.offload, select=is_expert_group, swapped=bool(dp.nvme_path))
            parts.append(expert_zero)
            expert_part = (expert_zero, DeviceMesh.from_group(experts.edp_group, mesh.device_mesh.device_type))
        if dp.nvme_path:
            optimizer = NvmeOptimizer([(z, g) for z in parts for g in z.groups], dp.nvme_path,
                                      lambda decay, no_decay: build_adamw(decay, no_decay, config.optim), dist.get_rank(),
                                      dp.nvme_sub_group)
        else:
            decay = [p for z in parts for p in z.master_parameters(True)]
            no_decay = [p for z in parts for p in z.master_parameters(False)]
            optimizer = build_adamw(decay, no_decay, config.optim)
        device_mesh = checkpoint_mesh(mesh, degrees)
        return ZeroSync(zero, optimizer, norm, device_mesh, tied_group, loss_group, expert_part)
    ddp = expert_ddp = None
    priority = comm.schedule == "priority"
    named = list(model.named_parameters())
    expert_params = [p for n, p in named if is_expert_parameter(n)]
    dense = [p for n, p in named if not is_expert_parameter(n)] if expert_params else None
    if experts is not None and experts.edp_group is not None and expert_params:
        reducer = build_reducer(experts.edp_group, comm.allreduce_algorithm, comm.compression, comm.node_size,
                                block=comm.compression_block, topk_ratio=comm.topk_ratio,
                                powersgd_rank=comm.powersgd_rank, seed=config.train.seed)
        expert_ddp = DataParallel(model, experts.edp_group, comm.bucket_mb, reduce_dtype, reducer, expert_params)
    if loss_group is not None:
        # the priority schedule's thread outlives the step: it gets a group of its own
        group = mesh.private_copy(loss_group) if priority else loss_group
        reducer = build_reducer(group, comm.allreduce_algorithm, comm.compression, comm.node_size,
                                block=comm.compression_block, topk_ratio=comm.topk_ratio,
                                powersgd_rank=comm.powersgd_rank, seed=config.train.seed)
        if priority:
            ddp = PriorityDataParallel(model, group, comm.bucket_mb, reduce_dtype, reducer, comm.slice_mb)
        else:
            ddp = DataParallel(model, loss_group, comm.bucket_mb, reduce_dtype, reducer, dense)
    if priority and ddp is not None:
        return PrioritySync(model, build_optimizer(model, config.optim), ddp, norm, tied_group, loss_group)
    return DDPSync(model, build_optimizer(model, config.optim), ddp, norm, tied_group, loss_group, expert_ddp, replicas)


def build_step(model: Transformer, folds: ModelParallel, sync: GradientSync, mesh: Mesh, config: JobConfig,
               stages: list[PipelineStage] | None, autocast: Callable) -> SingleStageStep | PipelineStep:
    """The step function, chosen once: one stage, or this rank's pipeline schedule."""
    dp_rank, dp = mesh.local_rank("dp"), mesh.dims.dp
    t, pipe, tensor = config.train, config.pipeline_parallel, config.tensor_parallel
    logits_loss = folds.loss_sum
    if t.compile and folds.tp_group is None and not t.loss_chunk_tokens:
        logits_loss = compiled_loss()  # the vocab-parallel loss has collectives inside: it stays eager
    loss = OutputLoss(logits_loss, model, folds.vocab_size, folds.tp_group, t.loss_chunk_tokens, DTYPES[t.dtype])
    if stages is None:
        return SingleStageStep(model, loss, sync, autocast, dp_rank, dp, mesh.group("dp_cp"))
    shape = PipelineShape(pipe.degree, t.grad_accum_steps, pipe.virtual)
    seq = t.seq_len // config.context_parallel.degree // (tensor.degree if tensor.sequence_parallel else 1)
    dtype = next(model.parameters()).dtype  # the residual stream's dtype (autocast leaves it)
    executor = PipelineExecutor(model, stages, shape, pipe.schedule, mesh.group("pp"), loss,
                                (t.micro_batch_size, seq, model.config.dim), dtype, next(model.parameters()).device,
                                autocast, folds.tp_group if pipe.scatter_gather else None)
    return PipelineStep(executor, pipe.schedule, sync, mesh.group("pp"), dp_rank, dp, mesh.group("dp_cp"))


def gather_layout(local: CheckpointLayout, mesh: Mesh, experts_split: bool = False) -> CheckpointLayout:
    """Every tensor-parallel piece, pipeline stage's and expert's groups (collective when the model is split)."""
    if mesh.dims.tp == 1 and mesh.dims.pp == 1 and not experts_split:
        return local
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local.to_json())
    merged = CheckpointLayout({})
    for part in everyone:
        merged = merged.merged(CheckpointLayout.from_json(part))
    return merged


def parallelize(model: Transformer, mesh: Mesh, config: JobConfig, device: torch.device,
                autocast: Callable, pretrained: bool = True) -> Parallelized:
    """Cut, materialise and parallelize a meta-device model; every rank calls this (it is collective).

    pretrained: read model.init_from_hf's weights when it is set (False when a checkpoint will overwrite them).
    """
    pipe, t = config.pipeline_parallel, config.train
    split, stages = None, None
    if pipe.degree > 1:  # keep only this rank's stages, before any memory is allocated
        split = check_pipeline(model.config, pipe, t.seq_len, t.grad_accum_steps)
        stages = stages_of_rank(split, pipe.degree, mesh.local_rank("pp"))
        cut_model(model, stages)
    experts, ep = None, config.expert_parallel
    sequence_parallel = config.tensor_parallel.sequence_parallel and config.tensor_parallel.degree > 1
    placements = {}
    if model.config.n_experts:  # keep only this rank's experts (load-aware placement with replicas: EPLB)
        experts = build_expert_groups(mesh, ep.degree, sequence_parallel, ep.tensor)
        placements = placements_for(model.config.moe_layers, model.config.n_experts, ep.degree, ep.replicas, ep.load_from)
        if ep.degree > 1:
            cut_experts(model, placements, experts.ep_rank)
    model = materialize(model, device, seed=t.seed)
    if pretrained and model.config.init_from_hf:
        load_hf_weights(model, model.config.init_from_hf)
    if experts is not None:
        shard_experts(model, experts.etp, experts.etp_rank)
    if t.fp8:  # before recomputation wraps the blocks
        apply_fp8(model)
    folds = apply_model_parallel(model, mesh, config.tensor_parallel, config.context_parallel, t.recompute, stages)
    norm = folds.grad_norm()
    meter, replicas = AllToAllMeter(), None
    if experts is not None:
        apply_routing_groups(model, mesh, sequence_parallel, ep.kernel, 1.0 / t.grad_accum_steps)
        apply_expert_parallel(model, experts, placements, ep.alltoall, meter)
        replicas = ReplicaGradients(model, mesh, experts, placements)
        expert_ids = frozenset(id(p) for n, p in model.named_parameters() if is_expert_parameter(n))
        norm = dataclasses.replace(norm, moe=True, experts=expert_ids, expert_replicas=replicas.counts,
                                   expert_groups=tuple(g for g in (experts.ep_group, experts.etp_group, mesh.group("pp"))
                                                       if g is not None))
    tied_group = None  # first and last pipeline stage, which both hold a tied embedding
    if stages is not None and model.config.tie_embeddings:
        tied_group = mesh.subgroup(tied_embedding_rows(mesh.rank_table("pp"), (len(split) - 1) % pipe.degree))
    if t.compile:  # after every fold has rewritten the blocks, before data parallelism hooks in
        apply_compile(model)
    local = local_layout(model, folds.piece_ranks(experts))  # before ZeRO empties the parameters
    parameters = sum(p.numel() for p in model.parameters())
    sync = apply_data_parallel(model, mesh, config, norm, tied_group, experts, replicas if replicas and replicas.sets else None)
    if experts is not None and experts.active:
        sync.gathers_in_forward = True  # every expert-parallel peer must run each forward (its all-to-alls)
    step = build_step(model, folds, sync, mesh, config, stages, autocast)
    return Parallelized(model, folds, sync, step, tuple(map(tuple, split)) if split else None,
                        gather_layout(local, mesh, experts is not None and experts.active), local, parameters, mesh.local_rank("dp"), experts, meter)
