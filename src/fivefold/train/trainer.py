"""The training loop, single-process or data-parallel over torch.distributed.

Each optimizer step draws its global batch from the stateless sampler (each data-parallel rank
takes its slice), runs forward and backward on each micro-batch, and normalises by the step's
total number of target tokens over all ranks (token-weighted, so accumulation and data
parallelism over uneven micro-batches give the full-batch gradient):
    loss = sum over ranks and micro-batches of sum_t CE_t  /  total target tokens of the step.
Gradients are summed across data-parallel ranks by our DDP (parallel/data_parallel.py), once,
after the last micro-batch. Then the global gradient norm is clipped, the scheduled learning
rate set, and AdamW stepped. With one process this is the reference every layout is tested against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from fivefold.config import JobConfig
from fivefold.data.dataset import PreparedData, eval_batches, prepare_data, sample_batch, unigram_cross_entropy
from fivefold.errors import CheckpointError, ConfigError
from fivefold.model import ModelConfig, Transformer, build_model, materialize
from fivefold.model.generate import generate
from fivefold.plan.flops import count_parameters, flops_per_token
from fivefold.plan.memory import ModelStateBytes, zero_model_states
from fivefold.comm.reducers import build_reducer
from fivefold.parallel.comm_schedule import PriorityDataParallel, private_group
from fivefold.parallel.data_parallel import DataParallel
from fivefold.parallel.parameter_server import ParameterServer, ServerClient, ServerLayout
from fivefold.parallel.mesh import build_mesh
from fivefold.parallel.parallelize import IGNORE_INDEX, parallelize
from fivefold.parallel.pipeline.executor import MicroBatch, PipelineExecutor
from fivefold.parallel.pipeline.schedules import PipelineShape, ideal_bubble
from fivefold.parallel.pipeline.stages import (
    build_tied_embedding_group,
    check_pipeline,
    cut_model,
    holds_tied_copy,
    stages_of_rank,
)
from fivefold.parallel.pipeline.trace import measure_bubble, write_chrome_trace
from fivefold.parallel.zero import ZeroDataParallel
from fivefold.train import checkpoint as ckpt
from fivefold.train.distributed import all_reduce_sum, init_distributed, local_device
from fivefold.train.memory import measure_model_states
from fivefold.train.metrics import MetricsLogger, peak_memory_gib, peak_tflops, plot_losses, read_metrics
from fivefold.train.optim import build_adamw, build_optimizer, lr_at, set_lr
from fivefold.train.train_state import capture_training_state, checkpoint_layout, restore_training_state


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float | None
    unigram_baseline: float
    checkpoint: Path | None
    metrics_path: Path
    plot_path: Path | None
    sample: str | None
    losses: list[float]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda but no CUDA device is available; use auto or cpu")
    return torch.device(name)


def resolve_model_config(model: ModelConfig, vocab_size: int) -> ModelConfig:
    """Fill in the tokenizer's vocabulary size, or check the configured one can hold it."""
    if model.vocab_size == 0:
        return dataclasses.replace(model, vocab_size=vocab_size)
    if model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size = {model.vocab_size} is smaller than the tokenizer's {vocab_size}: "
            "set model.vocab_size = 0 to take the tokenizer's"
        )
    return model


class Trainer:
    def __init__(self, config: JobConfig, data: PreparedData | None = None):
        self.config = config
        device = resolve_device(config.train.device)
        self.env = init_distributed(device)
        self.is_rank0 = self.env.is_rank0
        self.device = local_device(device, self.env)
        self.dims = config.parallel.dims(self.env.world_size)
        parameter_servers = config.parallel.dp_mode == "ps"  # pure data parallelism over the workers, no mesh
        self.mesh = build_mesh(self.dims, self.device.type) if self.env.world_size > 1 and not parameter_servers else None
        self.server, self.ps_client, self.ps_layout = None, None, None
        if parameter_servers and self._init_parameter_server(data):
            return  # a server rank: it serves in fit()
        self.dp_rank = self.mesh.local_rank("dp") if self.mesh is not None else 0  # which slice of each batch
        # Data- and context-parallel ranks together: gradients are summed and the loss token-weighted over them.
        self.dp_cp_group = self.mesh.group("dp_cp") if self.mesh is not None and self.dims.dp * self.dims.cp > 1 else None
        if parameter_servers:
            self.dp_rank, self.dp_cp_group = self.env.rank, self.workers_group
        self.pp_group = self.mesh.group("pp") if self.dims.pp > 1 else None
        self.pp_rank = self.mesh.local_rank("pp") if self.dims.pp > 1 else 0
        self.output_dir = Path(config.train.output_dir)
        self.data = data or self._prepare_data()
        self.model_config = resolve_model_config(config.model, self.data.tokenizer.vocab_size)
        torch.manual_seed(config.train.seed)
        model = build_model(self.model_config)
        self.stage_split, self.pipeline_stages = None, None
        if self.dims.pp > 1:  # keep only this rank's stages, before any memory is allocated
            t = config.train
            self.stage_split = check_pipeline(self.model_config, config.parallel, t.seq_len, t.grad_accum_steps)
            self.pipeline_stages = stages_of_rank(self.stage_split, self.dims.pp, self.pp_rank)
            cut_model(model, self.pipeline_stages)
        self.model: Transformer = materialize(model, self.device, seed=config.train.seed)
        self.parallel = parallelize(self.model, self.mesh, config.parallel)  # tensor/context parallel, recompute
        self.tied_group = None  # first and last pipeline stage, which both hold a tied embedding
        if self.dims.pp > 1:
            self.parallel.pp_group = self.pp_group
            if holds_tied_copy(self.model, self.pipeline_stages):
                self.parallel.duplicates = frozenset({id(self.model.tok_embeddings.weight)})
            if self.model_config.tie_embeddings:
                last = (len(self.stage_split) - 1) % self.dims.pp
                self.tied_group = build_tied_embedding_group(self.mesh.rank_table("pp"), self.env.rank, last)
        self.tp_prefix = f"tp{self.parallel.tp_rank}/" if self.parallel.tp > 1 else ""
        self.checkpoint_layout = self._gather_layout()  # before ZeRO-3 empties the parameters
        self.parameters_per_rank = sum(p.numel() for p in self.model.parameters())  # Ψ, or Ψ's TP shard
        self.resumed_from = self._resume_folder()
        self.ddp, self.zero = None, None
        par = config.parallel
        if par.dp_mode == "ps":
            if self.resumed_from is not None:
                raise ConfigError(f"checkpoint.resume with parallel.dp_mode = ps ({self.resumed_from}): the servers' "
                                  "optimizer states are not in checkpoints, so the run would not resume exactly; "
                                  "resume with dp_mode = ddp or start a new train.output_dir")
            sizes = [p.numel() for p in self.model.parameters() if p.requires_grad]
            self.ps_layout = ServerLayout.balance(sizes, self.dims.world_size, par.ps_servers)
            self.ps_client = ServerClient(self.model, self.ps_layout)
        reduce_dtype = torch.bfloat16 if par.reduce_dtype == "bf16" else torch.float32
        if par.zero_stage > 0:
            param_dtype = torch.bfloat16 if par.param_dtype == "bf16" else torch.float32
            replicate = self.mesh.group("dp_replicate") if self.dims.dp_replicate > 1 else None
            weighs = bool(self.parallel.norm_groups)
            self.zero = ZeroDataParallel(self.model, self.mesh.group("dp_shard_cp"), replicate, par.zero_stage,
                                         param_dtype, reduce_dtype, par.offload, norm_groups=self.parallel.norm_groups,
                                         norm_weight=self.parallel.norm_weight if weighs else None)
            self.optimizer = build_adamw(self.zero.master_parameters(True), self.zero.master_parameters(False), config.optim)
        else:
            if self.dp_cp_group is not None and self.ps_client is None:
                priority = par.comm_schedule == "priority"
                # the priority schedule's thread outlives the step: it gets a group of its own
                comm_group = private_group(self.dp_cp_group) if priority else self.dp_cp_group
                reducer = build_reducer(comm_group, par.allreduce_algorithm, par.compression, par.node_size,
                                        block=par.compression_block, topk_ratio=par.topk_ratio,
                                        powersgd_rank=par.powersgd_rank, seed=config.train.seed)
                if priority:
                    self.ddp = PriorityDataParallel(self.model, comm_group, par.bucket_mb, reduce_dtype, reducer,
                                                    par.slice_mb)
                else:
                    self.ddp = DataParallel(self.model, self.dp_cp_group, par.bucket_mb, reduce_dtype, reducer)
            self.optimizer = build_optimizer(self.model, config.optim)
        self.grad_sync = self.zero or self.ddp
        self.executor = self._build_executor() if self.dims.pp > 1 else None
        self.state = ckpt.TrainerState(step=0, tokens_seen=0, seed=config.train.seed)
        self.autocast_dtype = torch.bfloat16 if config.train.dtype == "bf16" else None
        t = config.train
        self.tokens_per_step = t.micro_batch_size * t.grad_accum_steps * self.dims.dp * t.seq_len
        self.flops_per_token = flops_per_token(self.model_config, t.seq_len)
        self.model_state_bytes: ModelStateBytes | None = None
        if self.resumed_from is not None:  # saved under any layout: DCP reads what this one needs
            restore_training_state(self.resumed_from, self.model, self.optimizer, self.zero, self.mesh, self.tp_prefix)
            self.state = ckpt.load_trainer_state(self.resumed_from)

    def _init_parameter_server(self, data: PreparedData | None) -> bool:
        """Parameter-server mode: the last ranks become servers (returns True there), the others its clients."""
        par, workers = self.config.parallel, self.dims.world_size
        self.output_dir = Path(self.config.train.output_dir)
        # every rank takes part in creating both groups
        self.workers_group = dist.new_group(list(range(workers))) if workers > 1 else None
        server_group = dist.new_group(list(range(workers, self.env.world_size))) if par.ps_servers > 1 else None
        if self.env.rank < workers:
            return False
        self.data = data or self._prepare_data()
        self.model_config = resolve_model_config(self.config.model, self.data.tokenizer.vocab_size)
        torch.manual_seed(self.config.train.seed)
        model = materialize(build_model(self.model_config), self.device, seed=self.config.train.seed)
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        self.ps_layout = ServerLayout.balance(sizes, workers, par.ps_servers)
        self.server = ParameterServer(model, self.ps_layout, self.env.rank - workers, self.config.optim,
                                      self.config.train.steps, par.ps_sync, par.ps_staleness,
                                      self.config.train.max_grad_norm, server_group)
        return True

    def expected_model_states(self) -> ModelStateBytes:
        """The ZeRO-paper formula for this run (before padding)."""
        par = self.config.parallel
        mixed = par.zero_stage > 0 and par.param_dtype == "bf16"
        return zero_model_states(self.parameters_per_rank, par.zero_stage, self.zero_shards, mixed)

    @property
    def zero_shards(self) -> int:
        """Ranks ZeRO shards over: data-parallel shards x context-parallel ranks (same weights, other tokens)."""
        return self.dims.dp_shard * self.dims.cp

    def describe_model_states(self) -> str:
        par, measured, expected = self.config.parallel, self.model_state_bytes, self.expected_model_states()
        mixed = par.zero_stage > 0 and par.param_dtype == "bf16"
        w, k, n = (2, 12, "N") if mixed else (4, 8, "N")
        shard = {0: ("", "", ""), 1: ("", "", f"/{n}"), 2: ("", f"/{n}", f"/{n}"), 3: (f"/{n}", f"/{n}", f"/{n}")}[par.zero_stage]
        rows = [("parameters", measured.parameters, expected.parameters, f"{w}Ψ{shard[0]}"),
                ("gradients", measured.gradients, expected.gradients, f"{w}Ψ{shard[1]}"),
                ("optimizer", measured.optimizer, expected.optimizer, f"{k}Ψ{shard[2]}"),
                ("total", measured.total, expected.total, "")]
        head = (f"model states per rank, measured | formula (ZeRO-{par.zero_stage}, "
                f"{'bf16 weights + fp32 masters' if mixed else 'fp32'}, Ψ = {self.parameters_per_rank:,}"
                f"{' (this rank’s tensor-parallel shard)' if self.dims.tp > 1 else ''}, "
                f"N = {self.zero_shards}{', offloaded to CPU' if par.offload else ''}):")
        return "\n".join([head] + [f"  {name:<10} {m:>14,} B | {e:>14,} B  {f}" for name, m, e, f in rows])

    def _prepare_data(self) -> PreparedData:
        """Rank 0 builds the token cache first; the others then only open it."""
        if self.env.world_size > 1 and not self.is_rank0:
            dist.barrier()
        data = prepare_data(self.config.data)
        if self.env.world_size > 1 and self.is_rank0:
            dist.barrier()
        return data

    def _resume_folder(self) -> Path | None:
        """The checkpoint to resume from, checked against this run's model settings."""
        folder = ckpt.resolve_resume(self.config.checkpoint.resume, self.output_dir)
        if folder is None:
            return None
        saved = ckpt.load_config_dict(folder)
        current = dataclasses.asdict(self.model_config)
        diffs = [k for k in current if k != "name" and saved.get("model", {}).get(k, current[k]) != current[k]]
        if diffs:
            raise CheckpointError(
                f"checkpoint {folder} was trained with different model settings ({', '.join('model.' + d for d in diffs)}); "
                "resume with the same model config or start a new train.output_dir"
            )
        ckpt.check_layout(folder, self.checkpoint_layout)
        return folder

    def _gather_layout(self) -> dict[str, dict]:
        """This run's checkpoint layout: every tensor-parallel rank's groups, under its prefix."""
        local = checkpoint_layout(self.model, self.tp_prefix)
        if self.dims.tp == 1 and self.dims.pp == 1:
            return local
        everyone: list = [None] * self.env.world_size  # tensor-parallel pieces and pipeline stages
        dist.all_gather_object(everyone, local)
        return {key: entry for part in everyone for key, entry in part.items()}

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def _build_executor(self) -> PipelineExecutor:
        t, par = self.config.train, self.config.parallel
        shape = PipelineShape(self.dims.pp, t.grad_accum_steps, par.pp_virtual)
        seq = t.seq_len // self.dims.cp // (self.dims.tp if par.sequence_parallel else 1)
        dtype = next(self.model.parameters()).dtype  # the residual stream's dtype (autocast leaves it)
        return PipelineExecutor(self.model, self.pipeline_stages, shape, par.pp_schedule, self.pp_group,
                                self.parallel.loss_sum, (t.micro_batch_size, seq, self.model_config.dim), dtype,
                                self.device, self._autocast)

    def describe_pipeline(self) -> str:
        par = self.config.parallel
        shape = self.executor.shape
        blocks = ", ".join(f"s{i}: {len(b)}" for i, b in enumerate(self.stage_split))
        return (f"pipeline: {par.pp_schedule}, {shape.ranks} ranks x {shape.virtual} stage(s) each, "
                f"{shape.microbatches} micro-batches; blocks per stage {blocks}; "
                f"ideal bubble {ideal_bubble(par.pp_schedule, shape):.3f} of compute time")

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """This rank's (inputs, labels, positions) micro-batches of optimizer step `step`.

        The data-parallel rank picks the samples; the context-parallel rank then its part of each
        sequence (positions None when the rank holds whole sequences).
        """
        t = self.config.train
        return [
            self._local(*sample_batch(self.data.train_tokens, t.seq_len, t.micro_batch_size, t.seed, step, i,
                                      t.grad_accum_steps, self.dp_rank, self.dims.dp))
            for i in range(t.grad_accum_steps)
        ]

    def _local(self, inputs: torch.Tensor, labels: torch.Tensor):
        return self.parallel.shard_sequence(inputs.to(self.device), labels.to(self.device))

    def _sync_context(self, micro_step: int, count: int):
        """No gradient communication on accumulation micro-steps, only on the last."""
        if self.grad_sync is not None and micro_step < count - 1:
            return self.grad_sync.no_sync()
        return contextlib.nullcontext()

    def train_step(self) -> dict[str, float]:
        """One optimizer step at `self.state.step`; returns its metrics."""
        step = self.state.step
        batches = self.micro_batches(step)
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in batches)
        if self.asynchronous_workers:  # each worker's gradient is the mean over its own tokens
            total_tokens = local_tokens
        else:
            total_tokens = int(all_reduce_sum(torch.tensor(float(local_tokens), device=self.device), self.dp_cp_group))
        if self.executor is not None:
            return self._pipeline_step(batches, total_tokens)
        loss_sum = torch.zeros((), device=self.device)
        for micro_step, (inputs, labels, positions) in enumerate(batches):
            with self._sync_context(micro_step, len(batches)):
                with self._autocast():
                    logits = self.model(inputs, positions=positions)
                loss = self.parallel.loss_sum(logits, labels)
                (loss / total_tokens).backward()
            loss_sum += loss.detach()
        if self.ps_client is not None:
            return self._parameter_server_step(loss_sum, total_tokens)
        self._reduce_gradients()
        all_reduce_sum(loss_sum, self.dp_cp_group)
        return self._optimizer_step(float(loss_sum), total_tokens)

    @property
    def asynchronous_workers(self) -> bool:
        return self.ps_client is not None and self.config.parallel.ps_sync != "bsp"

    def _parameter_server_step(self, loss_sum: torch.Tensor, total_tokens: int) -> dict[str, float]:
        """Push the gradients, pull the parameters; the servers ran the optimizer (clipping included)."""
        t = self.config.train
        if self.asynchronous_workers:  # a worker clips its own gradient; its loss is its own
            if t.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), t.max_grad_norm)
        else:
            all_reduce_sum(loss_sum, self.dp_cp_group)
        lr = lr_at(self.state.step, self.config.optim, t.steps)
        self.ps_client.push_pull()
        self.model.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += total_tokens
        return {"loss": float(loss_sum) / total_tokens, "lr": lr, "wire_bytes": self.ps_client.bytes_pushed}

    def _pipeline_step(self, batches, total_tokens: int) -> dict[str, float]:
        """The step as the pipeline schedule's instruction stream; the bubble measured on logging steps."""
        t = self.config.train
        step = self.state.step
        measure = (step + 1) % t.log_every == 0 or step + 1 == t.steps
        trace = self.config.logging.pipeline_trace and step + 1 == t.steps
        self.executor.synchronize = measure
        if measure:
            dist.barrier(group=self.pp_group)  # one time origin for every stage's events
        metrics: dict[str, float] = {}
        with self.grad_sync.no_sync() if self.grad_sync is not None else contextlib.nullcontext():
            loss_sum = self.executor.run([MicroBatch(*b) for b in batches], total_tokens, self._reduce_gradients,
                                         lambda: metrics.update(self._optimizer_step(None, total_tokens)))
        all_reduce_sum(loss_sum, self.dp_cp_group)
        all_reduce_sum(loss_sum, self.pp_group)  # only the last stage holds a loss
        metrics["loss"] = float(loss_sum) / total_tokens
        if measure:
            events: list = [None] * self.dims.pp
            dist.all_gather_object(events, self.executor.events, group=self.pp_group)
            bubble = measure_bubble(events)
            metrics.update(bubble=bubble.over_ideal, bubble_ideal=ideal_bubble(self.config.parallel.pp_schedule,
                                                                               self.executor.shape))
            if trace and self.is_rank0:
                shape = self.executor.shape
                info = {"schedule": self.config.parallel.pp_schedule, "ranks": shape.ranks,
                        "microbatches": shape.microbatches, "virtual": shape.virtual, "step": step + 1}
                path = write_chrome_trace(self.output_dir / "pipeline_trace.json", events, info)
                self._print(f"pipeline trace: {path} (measured bubble {bubble.over_ideal:.3f}, "
                            f"ideal {metrics['bubble_ideal']:.3f} of compute time)")
        return metrics

    def _reduce_gradients(self) -> None:
        """After the last backward: sum the tied embedding's two copies, then sync over data parallel."""
        if self.tied_group is not None:
            dist.all_reduce(self.model.tok_embeddings.weight.grad, group=self.tied_group)
        if self.grad_sync is not None:
            self.grad_sync.finish_gradient_sync()

    def _optimizer_step(self, loss_sum: float | None, total_tokens: int) -> dict[str, float]:
        """Clip, set the scheduled learning rate, step; advance the counters. Returns the step's metrics."""
        t = self.config.train
        step = self.state.step
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        lr = lr_at(step, self.config.optim, t.steps)
        set_lr(self.optimizer, lr)
        if self.zero is not None:
            grad_norm = self.zero.clip_grad_norm_(max_norm)
            self.zero.prepare_step()
            self.optimizer.step()
        elif isinstance(self.ddp, PriorityDataParallel):  # each module updates just before its next forward
            grad_norm = float("nan")  # no clipping (the config requires max_grad_norm = 0): not computed
            self.ddp.defer_update(lambda params, lr=lr: self._update(params, lr))
            if self.model_state_bytes is None:
                self.ddp.flush()
        else:
            grad_norm = self.parallel.clip_grad_norm_(list(self.model.parameters()), max_norm)
            self.optimizer.step()
        if self.model_state_bytes is None:  # every state exists now: measure once
            self.model_state_bytes = measure_model_states(self.model, self.optimizer, self.zero)
            self._print(self.describe_model_states())
        if self.zero is not None:
            self.zero.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += total_tokens
        metrics = {"lr": lr, "grad_norm": float(grad_norm)}
        if self.ddp is not None:
            metrics["wire_bytes"] = self.ddp.last_wire_bytes
        if loss_sum is not None:
            metrics["loss"] = loss_sum / total_tokens
        return metrics

    def _update(self, params: list[torch.nn.Parameter], lr: float) -> None:
        """AdamW on these parameters only (the others have no gradient now), at the step's learning rate."""
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def _apply_deferred_updates(self) -> None:
        if isinstance(self.ddp, PriorityDataParallel):
            self.ddp.flush()

    @torch.no_grad()
    def evaluate(self) -> float:
        self._apply_deferred_updates()
        t = self.config.train
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        batches = eval_batches(self.data.val_tokens, t.seq_len, t.micro_batch_size, t.eval_batches)
        if self.executor is not None:  # the batches flow through the stages; the loss sum lands on the last
            mine = [self._local(*batches[i]) for i in range(self.dp_rank, len(batches), self.dims.dp)]
            totals[0] += self.executor.forward_only([MicroBatch(*b) for b in mine])
            totals[1] += sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in mine)
        else:
            self._evaluate_whole_model(batches, totals)
        self.model.train()
        all_reduce_sum(totals, self.dp_cp_group)
        if self.pp_group is not None:  # the loss sum lives on the last stage; the token count everywhere
            totals[0] = all_reduce_sum(totals[0].clone(), self.pp_group)
        return float(totals[0] / totals[1])

    def _evaluate_whole_model(self, batches, totals: torch.Tensor) -> None:
        """Add this rank's loss sum and token count; each data-parallel rank takes every dp-th batch.

        ZeRO-3 gathers weights collectively inside forward, so a rank left without a batch still
        runs (and discards) one to keep in step.
        """
        rounds = -(-len(batches) // self.dims.dp)
        for index in range(self.dp_rank, rounds * self.dims.dp, self.dims.dp):
            counted = index < len(batches)
            if not counted and (self.zero is None or self.zero.stage != 3):
                continue
            inputs, labels, positions = self._local(*(batches[index] if counted else batches[0]))
            with self._autocast():
                logits = self.model(inputs, positions=positions)
            if counted:
                totals[0] += self.parallel.loss_sum(logits, labels).double()
                totals[1] += int((labels != IGNORE_INDEX).sum())

    def save(self) -> Path:
        """Write a checkpoint; in a distributed run every rank must call this (each writes its shards)."""
        self._apply_deferred_updates()
        workers_only = self.ps_client is not None  # the servers are serving: only the workers write
        return ckpt.save_checkpoint(
            self.output_dir, capture_training_state(self.model, self.optimizer, self.zero, self.mesh, self.tp_prefix),
            self.checkpoint_layout, self.state, self.config_dict(), self.data.tokenizer,
            self.config.checkpoint.keep_last,
            group=self.dp_cp_group if workers_only else None,
            distributed=(self.dp_cp_group is not None) if workers_only else None,
        )

    def config_dict(self) -> dict:
        resolved = self.config.to_dict()
        resolved["model"] = dataclasses.asdict(self.model_config)
        return resolved

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        tok = self.data.tokenizer
        generator = torch.Generator().manual_seed(self.config.train.seed)
        self.model.eval()
        ids = generate(self.model, tok.encode(prompt), max_new_tokens, temperature=0.8, top_k=40,
                       eos_id=tok.eos_id, generator=generator)
        self.model.train()
        return prompt + tok.decode(ids)

    def fit(self) -> TrainResult:
        """Train to `train.steps`, evaluating, logging and checkpointing on the way."""
        if self.server is not None:
            self.server_clock_log = self.server.serve()
            return TrainResult(self.config.train.steps, float("nan"), None, float("nan"), None,
                               self.output_dir / "metrics.jsonl", None, None, [])
        t, c, log = self.config.train, self.config.checkpoint, self.config.logging
        if self.is_rank0:
            self._trim_metrics()
        metrics = MetricsLogger(self.output_dir, log.tensorboard) if self.is_rank0 else None
        peak, peak_source = peak_tflops(self.device, t.peak_tflops)
        params = count_parameters(self.model_config).total
        self._print(
            f"model {self.model_config.name}: {params:,} parameters, {self.flops_per_token / 1e6:.1f} MFLOP/token; "
            f"{self.tokens_per_step:,} tokens/step; {self.env.world_size} rank(s), "
            f"{self.dims.describe_degrees()}; "
            f"peak {peak:.3f} TFLOP/s per rank ({peak_source})"
            + (f"; resumed from {self.resumed_from}" if self.resumed_from else "")
        )
        if self.executor is not None:
            self._print(self.describe_pipeline())
        losses: list[float] = []
        val_loss = None
        last_checkpoint = self.resumed_from
        bar = tqdm(total=t.steps, initial=self.state.step, disable=not (self.is_rank0 and log.progress),
                   desc="train", unit="step", dynamic_ncols=True)
        window_start, window_tokens = time.perf_counter(), 0
        while self.state.step < t.steps:
            values = self.train_step()
            losses.append(values["loss"])
            window_tokens += self.tokens_per_step
            step = self.state.step
            bar.update(1)
            if step % t.log_every == 0 or step == t.steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_tokens / elapsed
                values.update(
                    tokens_per_s=tokens_per_s,
                    mfu=self.flops_per_token * tokens_per_s / (peak * 1e12 * self.env.world_size),
                    peak_mem_gib=peak_memory_gib(self.device),
                    tokens_seen=self.state.tokens_seen,
                )
                if self.ddp is not None and self.ddp.overlap.hidden_fraction() is not None:
                    values["comm_hidden"] = self.ddp.overlap.hidden_fraction()  # since the last log
                    self.ddp.overlap.reset()
                if metrics:
                    metrics.log(step, values)
                bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}", mfu=f"{values['mfu']:.1%}")
                window_start, window_tokens = time.perf_counter(), 0
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                val_loss = self.evaluate()
                if metrics:
                    metrics.log(step, {"val_loss": val_loss})
                self._print(f"step {step}: validation loss {val_loss:.4f}")
            if c.enabled and ((c.every and step % c.every == 0) or step == t.steps):
                last_checkpoint = self.save()
        bar.close()
        self._apply_deferred_updates()
        if metrics:
            metrics.close()
        return self._finish(losses, val_loss, last_checkpoint)

    def _finish(self, losses: list[float], val_loss: float | None, checkpoint: Path | None) -> TrainResult:
        log = self.config.logging
        baseline = unigram_cross_entropy(self.data.train_tokens, self.data.val_tokens, self.data.tokenizer.vocab_size)
        metrics_path = self.output_dir / "metrics.jsonl"
        plot = None
        if self.is_rank0 and log.plot:
            plot = plot_losses(metrics_path, self.output_dir / "loss.png", baseline)
        # ZeRO-3 gathers weights collectively inside forward, so every rank must generate.
        stage3 = self.zero is not None and self.zero.stage == 3
        split = self.dims.tp > 1 or self.dims.cp > 1 or self.dims.pp > 1  # no rank holds the whole model or sequence
        wanted = (self.is_rank0 or stage3) and log.sample_prompt and log.sample_tokens and not split
        if log.sample_prompt and log.sample_tokens and split:
            self._print("sample: generation runs in one process; use `fivefold generate --checkpoint` on this run")
        sample = self.sample(log.sample_prompt, log.sample_tokens) if wanted else None
        final = losses[-1] if losses else float("nan")
        self._print(f"final train loss {final:.4f}" + (f", validation loss {val_loss:.4f}" if val_loss is not None else "")
                    + f"; unigram baseline {baseline:.4f} nats/token")
        self._print(f"checkpoint: {checkpoint}\nmetrics:    {metrics_path}" + (f"\nplot:       {plot}" if plot else "")
                    + (f"\ntensorboard: {self.output_dir / 'tensorboard'}" if log.tensorboard else ""))
        if sample is not None:
            self._print("sample:\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
        return TrainResult(self.state.step, final, val_loss, baseline, checkpoint, metrics_path, plot, sample, losses)

    def _trim_metrics(self) -> None:
        """On resume, drop metric records past the resumed step so the log reads as one run."""
        path = self.output_dir / "metrics.jsonl"
        records = read_metrics(path)
        if records and any(r["step"] > self.state.step for r in records):
            kept = [r for r in records if r["step"] <= self.state.step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def _print(self, text: str) -> None:
        if self.is_rank0:
            tqdm.write(text)
