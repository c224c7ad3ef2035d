"""Check a run's configuration against what each fold accepts, before any work starts.

The config package checks values on their own and the rules tying sections together; the names a
fold accepts and what a model must satisfy to be split its way live beside the fold and are
checked from here: the all-reduce algorithms and codecs (comm/), the gradient schedules, the
parameter server's consistency models, recomputation modes, context-parallel attention methods
and their divisibility, tensor-parallel divisibility, the pipeline schedule and stage split, the
fault kinds, and that a tokenizer given as a path exists.
`fivefold train`, `Trainer` and `roles.run` call `check_config` first.
"""

from __future__ import annotations

from pathlib import Path

from fivefold.comm.compression import CODECS
from fivefold.comm.reducers import ALGORITHMS
from fivefold.config import JobConfig, check_choice
from fivefold.errors import ConfigError
from fivefold.reliability.faults import FAULT_KINDS
from fivefold.parallel.comm_schedule import SCHEDULES as COMM_SCHEDULES
from fivefold.model.moe import EXPERT_KERNELS
from fivefold.parallel.context_parallel import check_context_parallel
from fivefold.parallel.expert_parallel import check_expert_parallel
from fivefold.parallel.parameter_server import SYNC_MODES
from fivefold.parallel.pipeline.schedules import SCHEDULES as PIPELINE_SCHEDULES
from fivefold.parallel.pipeline.stages import BALANCE_BY, check_pipeline
from fivefold.parallel.recompute import RECOMPUTE_MODES
from fivefold.parallel.tensor_parallel import check_tensor_parallel


def check_config(config: JobConfig) -> JobConfig:
    """Raise ConfigError naming the setting and the fix; returns the config for chaining."""
    comm, cp, tp, t = config.gradient_comm, config.context_parallel, config.tensor_parallel, config.train
    check_choice("gradient_comm.allreduce_algorithm", comm.allreduce_algorithm, ALGORITHMS)
    check_choice("gradient_comm.compression", comm.compression, CODECS)
    check_choice("gradient_comm.schedule", comm.schedule, COMM_SCHEDULES)
    check_choice("parameter_server.sync", config.parameter_server.sync, SYNC_MODES)
    check_choice("train.recompute", t.recompute, RECOMPUTE_MODES)
    check_choice("fault.kind", config.fault.kind, FAULT_KINDS)
    tokenizer = config.data.tokenizer
    if tokenizer not in ("byte", "bpe") and not Path(tokenizer).is_file() and not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ConfigError(f"data.tokenizer = {tokenizer!r} is neither byte nor bpe, nor a tokenizer.json file or a "
                          "Hugging Face tokenizer folder (holding tokenizer.json) that exists")
    check_context_parallel(config.model, cp.degree, cp.method, cp.heads, tp.degree, t.seq_len, cp.inner_ring)
    # Tensor (and sequence) parallelism sees each context-parallel rank's part of the sequence.
    check_tensor_parallel(config.model, tp.degree, tp.sequence_parallel, t.seq_len // cp.degree, tp.comm_overlap)
    check_choice("pipeline_parallel.schedule", config.pipeline_parallel.schedule, PIPELINE_SCHEDULES)
    check_choice("pipeline_parallel.balance", config.pipeline_parallel.balance, BALANCE_BY)
    if config.pipeline_parallel.degree > 1:
        check_pipeline(config.model, config.pipeline_parallel, t.seq_len, t.grad_accum_steps)
    check_moe(config)
    if t.fp8 and tp.degree > 1:
        raise ConfigError(f"train.fp8 = true with tensor_parallel.degree = {tp.degree}: FP8 swaps the blocks' plain "
                          "nn.Linear layers, and tensor parallelism has replaced them; use one of the two")
    return config


def check_moe(config: JobConfig) -> None:
    """Mixture-of-experts settings against the folds they meet."""
    ep, model = config.expert_parallel, config.model
    check_choice("expert_parallel.kernel", ep.kernel, EXPERT_KERNELS)
    check_expert_parallel(model, ep.degree, ep.alltoall, etp=ep.tensor)
    if not model.n_experts:
        return
    if config.data_parallel.mode == "ps":
        raise ConfigError("model.n_experts > 0 with data_parallel.mode = ps: parameter servers hold whole dense models; "
                          "use data_parallel.mode = ddp (or ZeRO) for mixture-of-experts models")
    if config.gradient_comm.schedule == "priority":
        raise ConfigError("gradient_comm.schedule = priority re-orders one dense all-reduce stream; routed experts are "
                          "reduced over their own group: use schedule = fifo with model.n_experts > 0")
    if ep.replicas and config.data_parallel.zero_stage:
        raise ConfigError(f"expert_parallel.replicas with data_parallel.zero_stage = {config.data_parallel.zero_stage}: "
                          "replicated experts are summed over their holders as whole gradients; use DDP (zero_stage 0)")
    split_sequence = config.context_parallel.degree > 1 or (config.tensor_parallel.sequence_parallel
                                                             and config.tensor_parallel.degree > 1)
    if model.moe_capacity_factor and split_sequence:
        raise ConfigError(f"model.moe_capacity_factor = {model.moe_capacity_factor} ranks each sequence's tokens per "
                          "expert, but context or sequence parallelism splits the sequence over ranks: use dropless "
                          "routing (moe_capacity_factor = 0) with them, or turn them off")
