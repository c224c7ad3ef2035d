"""The run configuration's schema: one dataclass per section, each field documented under it.

One `JobConfig` drives everything: the trainer, the benchmarks, and later the planner and the
simulator read the same objects. The parallel settings are grouped by fold, so a reader sees
which knob belongs to which method:

    [data_parallel]      replicas, ZeRO shards and stage, mixed precision, offload, ddp or ps
    [tensor_parallel]    degree, sequence parallelism
    [context_parallel]   degree, attention method (ring, Ulysses, 2D), head-parallel degree
    [pipeline_parallel]  degree, schedule, virtual stages, stage split
    [gradient_comm]      DDP buckets, reduce dtype, all-reduce algorithm, compression, scheduling
    [parameter_server]   servers, consistency model, staleness bound

`validate()` checks what each value can be on its own and how sections constrain each other.
Which names a fold accepts (all-reduce algorithms, codecs, schedules, attention methods, ...) is
written once, beside the fold, and checked there (`fivefold.parallel.validate.check_config`), so
this package imports nothing from parallel/, comm/ or train/.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.presets import get_preset

DTYPES = ("fp32", "bf16")
QUANTIZED_GRADIENTS = ("none", "int8", "int4")
PIPELINE_PLACEMENTS = ("outer", "inner")  # parallel/mesh.py: the pipeline outermost, or inside data parallelism


def did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(key: str, value: str, choices: Iterable[str]) -> None:
    """A ConfigError naming the key, the choices and the closest one, unless value is among them."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(choices)}{did_you_mean(str(value), choices)}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ConfigError(f"{section}.{name} = {getattr(obj, name)}: must be a positive integer")


def _at_least(section: str, obj: Any, low: float, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) >= low:  # also refuses nan
            raise ConfigError(f"{section}.{name} = {getattr(obj, name)}: must be >= {low}")


@functools.cache
def _number_fields(kind: type) -> tuple[str, ...]:
    """The fields of a config section that may hold a float (annotated float, or not annotated as a
    str, bool, int or list): the only ones `_finite` has to look at."""
    plain = {"str", "bool", "int", "list[str]", "list[int]"}
    return tuple(f.name for f in dataclasses.fields(kind) if str(f.type) not in plain)


def _finite(section: str, obj: Any) -> None:
    """Every float of a section is a number: nan and inf are refused wherever they come from (TOML, CLI, code)."""
    for name in _number_fields(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{name} = {value}: must be a finite number")


@dataclass
class DataConfig:
    source: str = "stdlib"
    """`stdlib` (the running interpreter's standard library source, the embedded default corpus)
    or a path to a .txt/.jsonl file or a folder of them (comma-separate several paths)."""
    tokenizer: str = "byte"
    """`byte` (256 byte values + end-of-text), `bpe` (trained locally on the train split), a path to
    a saved `tokenizer.json`, or a Hugging Face tokenizer folder (tokenizer.json, and its tokenizer_config.json's
    eos_token ends each document; its files, chat template included, are kept unchanged)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size when training a BPE tokenizer."""
    val_fraction: float = 0.05
    """Fraction of files (chosen by a hash of their path) held out for validation."""
    jsonl_field: str = "text"
    """Field of each .jsonl record that holds the text."""
    cache_dir: str = ".cache/fivefold"
    """Where pre-tokenised token files and trained tokenizers are cached."""

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction = {self.val_fraction}: must lie strictly between 0 and 1")
        if self.bpe_vocab_size < 257:
            raise ConfigError(f"data.bpe_vocab_size = {self.bpe_vocab_size}: must be at least 257 (all bytes + end-of-text)")
        if not self.source:
            raise ConfigError("data.source is empty: use `stdlib` or a path to your text")


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps to run."""
    seq_len: int = 256
    """Tokens per sample."""
    micro_batch_size: int = 16
    """Samples per forward/backward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (global batch = micro x accum x dp)."""
    seed: int = 1234
    """Seed for weight init and the data sampler."""
    dtype: str = "fp32"
    """Compute dtype: `fp32`, or `bf16` (autocast; parameters and optimizer stay fp32)."""
    device: str = "auto"
    """`auto` (cuda if available, else cpu), `cpu` or `cuda`."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_every: int = 50
    """Evaluate the validation loss every N steps (and at the end); 0 disables."""
    eval_batches: int = 8
    """Micro-batches in one validation pass (fixed windows, identical every time)."""
    log_every: int = 10
    """Write metrics every N steps."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s for MFU; 0 = look up the device table (GPU) or measure a matmul (CPU)."""
    output_dir: str = "runs/default"
    """Folder for checkpoints, metrics.jsonl, TensorBoard events and the loss plot."""
    recompute: str = "none"
    """Activation recomputation: `none`, `full` (each block's forward again in backward) or `selective` (attention core only)."""
    compile: bool = False
    """torch.compile each transformer block (fused Triton kernels for its norms, RoPE and SwiGLU on CUDA) and the loss (no fp32 logits kept), docs/gpu.md."""
    fp8: bool = False
    """Run the blocks' linear layers in FP8 (e4m3 forward, e5m2 gradients, per-tensor current scaling; torch._scaled_mm on H100-class GPUs, the same numerics emulated elsewhere; docs/gpu.md). Not with tensor parallelism."""
    loss_chunk_tokens: int = 0
    """Apply the LM head and cross-entropy this many tokens at a time, recomputing each chunk's logits in backward, so the full tokens x vocab logits never exist (docs/gpu.md); 0 = the plain head."""
    threads: int = 0
    """Intra-op CPU threads per rank; 0 = the cores this process may use divided by the ranks on this machine (at least 1), so ranks x threads <= cores."""

    def validate(self) -> None:
        _positive("train", self, "steps", "seq_len", "micro_batch_size", "grad_accum_steps", "eval_batches", "log_every")
        _at_least("train", self, 0, "eval_every", "max_grad_norm", "peak_tflops", "threads", "loss_chunk_tokens")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"train.seed = {self.seed}: must lie in [0, 2**63)")
        check_choice("train.dtype", self.dtype, ("fp32", "bf16"))
        check_choice("train.device", self.device, ("auto", "cpu", "cuda"))
        if not self.output_dir:
            raise ConfigError("train.output_dir is empty: name the folder for checkpoints and metrics")



@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and linear schedules)."""
    warmup_steps: int = 20
    """Linear warmup from 0 to the peak over this many steps."""
    schedule: str = "cosine"
    """Decay after warmup: `cosine`, `linear` or `constant`."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam denominator epsilon."""

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr = {self.lr}: must be positive")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps = {self.eps}: must be positive (Adam divides by sqrt(v) + eps)")
        _at_least("optim", self, 0, "weight_decay", "warmup_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio = {self.min_lr_ratio}: must lie in [0, 1]")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name} = {getattr(self, name)}: must lie in [0, 1)")
        check_choice("optim.schedule", self.schedule, ("cosine", "linear", "constant"))


@dataclass
class CheckpointConfig:
    every: int = 100
    """Save a checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Keep the newest K checkpoints, delete older ones."""
    resume: str = "none"
    """`none`, `auto` (newest complete checkpoint in train.output_dir, if any) or a checkpoint folder."""
    enabled: bool = True
    """Write checkpoints at all."""
    async_save: bool = False
    """Copy the state to host memory and write it on a background thread while training goes on; the next save waits for the one in flight."""
    overwrite: bool = False
    """A fresh run (resume = none) into a train.output_dir holding another run's checkpoints or metrics is refused unless this is true, which removes that run's files first."""
    allow_changes: bool = False
    """Resume even though settings that decide each step's data changed (train.seed, train.seq_len, the global batch, [data]); they are listed either way."""

    def validate(self) -> None:
        _at_least("checkpoint", self, 0, "every")
        _positive("checkpoint", self, "keep_last")
        if not self.resume:
            raise ConfigError("checkpoint.resume is empty: use none, auto or a checkpoint folder")


@dataclass
class LoggingConfig:
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    tensorboard: bool = True
    """Write TensorBoard events to <output_dir>/tensorboard."""
    plot: bool = True
    """Write <output_dir>/loss.png at the end."""
    sample_prompt: str = "def "
    """Prompt for the sample generated at the end of training; empty disables it."""
    sample_tokens: int = 200
    """Tokens generated for that sample."""
    pipeline_trace: bool = False
    """With pipeline_parallel.degree > 1: write a Chrome trace of the last step's measured compute and communication per stage (<output_dir>/pipeline_trace.json)."""
    moe_load_by_rank: bool = True
    """With expert parallelism: record each expert-parallel position's load per MoE layer (moe_load_by_ep_rank in metrics.jsonl, what `fivefold simulate/plan --expert-load` replays rank by rank); costs experts x ep float64 per MoE layer in the step's routing all-reduce and as many numbers per logged step."""

    def validate(self) -> None:
        if self.sample_tokens < 0:
            raise ConfigError(f"logging.sample_tokens = {self.sample_tokens}: must be >= 0")


@dataclass
class DataParallelConfig:
    replicate: int = -1
    """Data-parallel replicas, each holding the whole model or a whole set of shards; -1 takes the ranks the other degrees leave."""
    shard: int = 1
    """Ranks the model states are sharded over with ZeRO (needs zero_stage >= 1); dp = replicate x shard."""
    zero_stage: int = 0
    """0: DDP (nothing sharded); 1: optimizer states; 2: + gradients; 3: + parameters (ZeRO)."""
    shard_params: int = 0
    """Ranks each parameter is sharded over (AMSP/MiCS, needs zero_stage >= 1); 0 = the stage's (shard x cp under stage 3, else 1), at most shard_grads. Must divide shard_grads."""
    shard_grads: int = 0
    """Ranks each gradient is sharded over (AMSP/MiCS); 0 = the stage's (shard x cp under stages 2-3, else 1), at most shard_optim. Must divide shard_optim."""
    shard_optim: int = 0
    """Ranks the optimizer states are sharded over (AMSP/MiCS); 0 = the stage's (shard x cp). Must divide the dp x cp ranks; the states are replicated over the rest."""
    param_dtype: str = "fp32"
    """Compute weights with ZeRO: `fp32`, or `bf16` with fp32 master shards (mixed precision)."""
    offload: bool = False
    """ZeRO-Offload: keep fp32 masters and optimizer states on the CPU and run the step there."""
    nvme_path: str = ""
    """ZeRO-Infinity (with offload): keep the fp32 masters and AdamW moments in a file under this directory on a local drive (NVMe), streamed through host memory group by group during the step; empty = host memory."""
    nvme_sub_group: int = 16_777_216
    """NVMe offload: elements of a flat group's shard swapped and stepped at once (DeepSpeed's sub_group_size); host memory holds 3 x 3 x 4 bytes x this at most."""
    mode: str = "ddp"
    """Data parallelism by all-reduce (`ddp`, with ZeRO when zero_stage > 0) or by parameter servers (`ps`: see [parameter_server])."""
    quantized_weights: bool = False
    """ZeRO++ qwZ (zero_stage 3): all-gather the weights as int8 blocks with one fp32 scale each (lossy, bounded)."""
    hpz_partition: int = 1
    """ZeRO++ hpZ (zero_stage 3): keep a secondary weight shard over this many ranks of one node so backward gathers stay in the node; 1 = off."""
    quantized_gradients: str = "none"
    """ZeRO++ qgZ (zero_stage 3): reduce-scatter gradients as `int8` or `int4` blocks by two all-to-alls, within then across nodes (lossy, bounded); `none` = off."""
    quantization_block: int = 256
    """Values per fp32 scale for quantized_weights and quantized_gradients (a positive multiple of 8)."""

    def validate(self) -> None:
        if self.replicate == 0 or self.replicate < -1:
            raise ConfigError(f"data_parallel.replicate = {self.replicate}: use a positive degree or -1 (all ranks)")
        _positive("data_parallel", self, "shard")
        check_choice("data_parallel.param_dtype", self.param_dtype, DTYPES)
        check_choice("data_parallel.mode", self.mode, ("ddp", "ps"))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"data_parallel.zero_stage = {self.zero_stage}: use 0 (DDP), 1, 2 or 3")
        if self.zero_stage == 0 and self.shard > 1:
            raise ConfigError(f"data_parallel.shard = {self.shard} shards model states with ZeRO: set data_parallel.zero_stage to 1, 2 or 3")
        if self.zero_stage == 0 and (self.param_dtype != "fp32" or self.offload):
            raise ConfigError("data_parallel.param_dtype = bf16 and data_parallel.offload need ZeRO: set data_parallel.zero_stage >= 1")
        if self.nvme_path and not self.offload:
            raise ConfigError(f"data_parallel.nvme_path = {self.nvme_path!r} moves offloaded optimizer states to a drive: "
                              "set data_parallel.offload = true (with zero_stage >= 1), or unset nvme_path")
        _positive("data_parallel", self, "nvme_sub_group")
        degrees = {n: getattr(self, n) for n in ("shard_params", "shard_grads", "shard_optim")}
        for name, degree in degrees.items():
            if degree < 0:
                raise ConfigError(f"data_parallel.{name} = {degree}: use a positive degree, or 0 for the zero_stage's")
        set_degrees = [n for n, d in degrees.items() if d]
        if set_degrees and self.zero_stage == 0:
            raise ConfigError(f"data_parallel.{set_degrees[0]} sets a ZeRO sharding degree: set data_parallel.zero_stage "
                              "to 1, 2 or 3 (its pattern gives the degrees you leave at 0)")
        _positive("data_parallel", self, "hpz_partition")
        check_choice("data_parallel.quantized_gradients", self.quantized_gradients, QUANTIZED_GRADIENTS)
        if self.quantization_block < 8 or self.quantization_block % 8:
            raise ConfigError(f"data_parallel.quantization_block = {self.quantization_block}: must be a positive multiple of 8")
        zero_pp = [name for name, on in (("quantized_weights", self.quantized_weights),
                                         ("hpz_partition", self.hpz_partition > 1),
                                         ("quantized_gradients", self.quantized_gradients != "none")) if on]
        if zero_pp and self.zero_stage != 3:
            raise ConfigError(f"data_parallel.{zero_pp[0]} is ZeRO++, which works on sharded weights: set "
                              f"data_parallel.zero_stage = 3 (it is {self.zero_stage})")

    @property
    def gradient_bits(self) -> int:
        """qgZ's bits per gradient value: 0 (off), 8 or 4."""
        return {"none": 0, "int8": 8, "int4": 4}[self.quantized_gradients]


@dataclass
class TensorParallelConfig:
    degree: int = 1
    """Tensor-parallel degree (Megatron): attention heads, MLP width and vocabulary split over this many ranks."""
    sequence_parallel: bool = False
    """With degree > 1: norms and residuals run on 1/degree of the sequence (all-gather / reduce-scatter instead of all-reduce)."""
    comm_overlap: bool = False
    """With sequence_parallel: each block's all-gathers and reduce-scatters run as collective matmuls, chunk by chunk over a ring, overlapped with the matmuls that need them."""

    def validate(self) -> None:
        _positive("tensor_parallel", self, "degree")
        if self.comm_overlap and not (self.sequence_parallel and self.degree > 1):
            raise ConfigError("tensor_parallel.comm_overlap overlaps sequence parallelism's all-gathers and reduce-scatters: "
                              "set tensor_parallel.sequence_parallel = true with tensor_parallel.degree > 1")


@dataclass
class ExpertParallelConfig:
    degree: int = 1
    """Expert-parallel degree: each mixture-of-experts layer's experts are split over this many ranks, tokens sent to them by all-to-all (docs/moe.md)."""
    tensor: int = 1
    """Expert tensor-parallel degree (ETP): each expert's hidden units are split over this many ranks (w1, w3 by rows, w2 by columns), which swap their rows by an all-gather and add their partial outputs by a reduce-scatter (docs/moe.md)."""
    alltoall: str = "torch"
    """Token dispatch: `torch` (torch.distributed.all_to_all_single) or `pairwise` (fivefold's hand-written pairwise exchange, comm/alltoall.py)."""
    kernel: str = "auto"
    """Local experts: `grouped` (one grouped GEMM per projection), `loop` (one matmul per expert), `auto` (grouped where torch has it and widths allow)."""
    replicas: int = 0
    """Load-aware placement (EPLB): spare expert slots per rank, filled with replicas of the hottest experts of each layer and placed to even the ranks' load; needs load_from."""
    load_from: str = ""
    """With replicas: an earlier run of the same model (its folder or metrics.jsonl) whose measured expert load (moe_load, last 10 logged steps) the placement balances."""

    def validate(self) -> None:
        _positive("expert_parallel", self, "degree", "tensor")
        if self.replicas < 0:
            raise ConfigError(f"expert_parallel.replicas = {self.replicas}: must be >= 0")
        if self.replicas and (self.degree < 2 or not self.load_from):
            raise ConfigError("expert_parallel.replicas places replicas of hot experts on other expert-parallel ranks "
                              "from a measured load: set expert_parallel.degree >= 2 and expert_parallel.load_from")
        if self.load_from and not self.replicas:
            raise ConfigError("expert_parallel.load_from is read only to place replicas: set expert_parallel.replicas "
                              ">= 1 or remove load_from")


@dataclass
class ContextParallelConfig:
    degree: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (load-balanced causal chunks)."""
    method: str = "ring"
    """Context-parallel attention: `ring` (K/V blocks passed around a ring), `ulysses` (all-to-all to heads) or `2d` (both)."""
    heads: int = 2
    """With method = 2d: the head-parallel (Ulysses) degree; the ring takes degree / heads ranks."""
    inner_ring: int = 0
    """Double-ring attention (LoongTrain), methods ring and 2d: the ring runs as rounds of an inner ring of this many ring ranks (e.g. those in one node), each round's first block moving one step on the outer ring meanwhile; must divide the ring's size; 0 = one ring."""
    placement: str = "head-first"
    """With method = 2d: `head-first` gives the head-parallel (Ulysses) group adjacent ranks (ring neighbours `heads` ranks apart), `context-first` gives them to the ring (head groups strided)."""

    def validate(self) -> None:
        _positive("context_parallel", self, "degree", "heads")
        check_choice("context_parallel.placement", self.placement, ("head-first", "context-first"))
        if self.inner_ring < 0:
            raise ConfigError(f"context_parallel.inner_ring = {self.inner_ring}: use 0 (one ring) or a positive divisor "
                              "of the ring's size")


@dataclass
class PipelineParallelConfig:
    degree: int = 1
    """Pipeline-parallel degree: the layers are split by depth over this many ranks; train.grad_accum_steps micro-batches flow through them."""
    schedule: str = "1f1b"
    """Pipeline schedule: `gpipe`, `1f1b`, `interleaved` (needs virtual >= 2) or `zb-h1` (zero bubble)."""
    virtual: int = 1
    """Virtual stages per pipeline rank (the interleaved schedule): degree x virtual stages in all."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Blocks per stage, e.g. `3,4,4,3`, overriding the balanced split; empty = balance by `balance`."""
    balance: str = "flops"
    """Cost the stage split balances: `flops` (training FLOPs, head included) or `params` (parameters, embedding included)."""
    scatter_gather: bool = False
    """With tensor_parallel.degree > 1 and no sequence parallelism: each tensor-parallel rank sends 1/degree of a stage's activation (and gradient) and the receiving stage all-gathers the pieces over its tensor-parallel group (Megatron-LM's scatter/gather): degree times fewer bytes between stages, one all-gather inside each."""
    placement: str = "outer"
    """Where the stages lie among the ranks: `outer` puts the pipeline outermost (ranks run pp, dp, cp, tp from slowest to fastest changing: a stage's data-parallel replicas are neighbours, its next stage dp x cp x tp ranks away), `inner` puts it inside data parallelism (dp, pp, cp, tp: one pipeline's stages are neighbours, its data-parallel replicas pp x cp x tp ranks apart; Megatron-LM's tp-pp-dp order). Neighbouring ranks share a node: `inner` keeps the stage-to-stage messages on the node's links and sends the gradient reduction across nodes."""

    def validate(self) -> None:
        _positive("pipeline_parallel", self, "degree", "virtual")
        if self.scatter_gather and self.degree == 1:
            raise ConfigError("pipeline_parallel.scatter_gather splits the messages between pipeline stages: set "
                              "pipeline_parallel.degree > 1 or leave scatter_gather off")
        check_choice("pipeline_parallel.placement", self.placement, PIPELINE_PLACEMENTS)
        if self.placement != "outer" and self.degree == 1:
            raise ConfigError(f"pipeline_parallel.placement = {self.placement!r} places pipeline stages: set "
                              "pipeline_parallel.degree > 1 or leave placement at 'outer'")
        if self.degree == 1 and (self.virtual > 1 or self.layers_per_stage):
            raise ConfigError("pipeline_parallel.virtual and pipeline_parallel.layers_per_stage split a pipeline: "
                              "set pipeline_parallel.degree > 1")


@dataclass
class GradientCommConfig:
    bucket_mb: float = 25.0
    """DDP gradient bucket size in MiB: smaller starts communication earlier, larger sends fewer messages."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in (DDP and ZeRO): `fp32`, or `bf16` (half the bytes on the wire, less precise)."""
    allreduce_algorithm: str = "native"
    """How DDP buckets are summed: `native` (the backend's), a hand-written `ring`, `halving_doubling`, `rabenseifner`, `butterfly`, `tree`, `double_tree`, `hierarchical`, `torus`, or `auto` (the cost model's fastest per bucket, links measured at start)."""
    node_size: int = 0
    """Ranks per node for `hierarchical` and `auto`, ZeRO++ and ZeRO's cross-node byte counts: 0 takes LOCAL_WORLD_SIZE; set it to split one machine into pretend nodes."""
    schedule: str = "fifo"
    """Order of DDP gradient communication: `fifo` (buckets as backward fills them) or `priority` (slices in next-forward order, each module's update deferred to its next forward; needs train.max_grad_norm = 0)."""
    slice_mb: float = 1.0
    """With schedule = priority: size of the slices buckets are cut into, in MiB."""
    compression: str = "none"
    """DDP gradient compression: `none`, `int8` (block quantised), `sign` (1 bit + scale, error feedback), `topk` (error feedback) or `powersgd` (low rank, error feedback)."""
    compression_block: int = 256
    """Values per scale for `int8` and `sign` (a multiple of 8)."""
    topk_ratio: float = 0.01
    """Fraction of each bucket's values `topk` sends."""
    powersgd_rank: int = 4
    """Rank r of the `powersgd` approximation of each weight matrix."""

    def validate(self) -> None:
        for name in ("bucket_mb", "slice_mb"):
            if not getattr(self, name) > 0:  # also refuses nan
                raise ConfigError(f"gradient_comm.{name} = {getattr(self, name)}: must be positive")
        check_choice("gradient_comm.reduce_dtype", self.reduce_dtype, DTYPES)
        if self.node_size < 0:
            raise ConfigError(f"gradient_comm.node_size = {self.node_size}: use 0 (LOCAL_WORLD_SIZE) or a positive rank count")
        if self.compression_block < 8 or self.compression_block % 8:
            raise ConfigError(f"gradient_comm.compression_block = {self.compression_block}: must be a positive multiple of 8")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"gradient_comm.topk_ratio = {self.topk_ratio}: must be in (0, 1]")
        _positive("gradient_comm", self, "powersgd_rank")


@dataclass
class ParameterServerConfig:
    servers: int = 1
    """With data_parallel.mode = ps: server ranks (the last ones) holding parameter shards and their optimizer."""
    sync: str = "bsp"
    """With data_parallel.mode = ps: `bsp` (synchronous, equals DDP), `asp` (asynchronous) or `ssp` (stale synchronous, bounded by staleness)."""
    staleness: int = 2
    """With sync = ssp: the most steps a worker may run ahead of the slowest."""

    def validate(self) -> None:
        _positive("parameter_server", self, "servers")
        if self.staleness < 0:
            raise ConfigError(f"parameter_server.staleness = {self.staleness}: must be >= 0")


@dataclass
class GuardConfig:
    enabled: bool = True
    """Check every step's loss and global gradient norm (one small all-reduce); a non-finite step is skipped, not applied."""
    max_bad_steps: int = 3
    """Bad steps in a row after which the run rolls back to its newest verified checkpoint."""
    max_rollbacks: int = 2
    """Rollbacks after which the run stops with an error naming the step."""
    rollback_lr_factor: float = 1.0
    """Multiply the learning rate by this at each rollback (1 keeps it; 0.5 halves it)."""
    skip_data_on_rollback: bool = True
    """After a rollback, skip the batches of the bad window (PaLM's recipe) instead of replaying them."""
    spike_zscore: float = 0.0
    """Also treat a step whose loss lies this many standard deviations above the recent mean as bad; 0 disables."""
    spike_window: int = 50
    """Good steps the spike detector's mean and deviation are taken over."""

    def validate(self) -> None:
        _positive("guard", self, "max_bad_steps")
        _at_least("guard", self, 0, "max_rollbacks", "spike_zscore")
        if not 0 < self.rollback_lr_factor <= 1:
            raise ConfigError(f"guard.rollback_lr_factor = {self.rollback_lr_factor}: must lie in (0, 1]")
        if self.spike_window < 2:
            raise ConfigError(f"guard.spike_window = {self.spike_window}: must be >= 2")


@dataclass
class WatchdogConfig:
    enabled: bool = True
    """Per-rank heartbeats and the watchdog (multi-process runs): hung ranks, stalled collectives, a dead launcher."""
    heartbeat_s: float = 10.0
    """Seconds between heartbeats; a rank silent for 1.5 heartbeats is declared hung (detected within 2)."""
    collective_timeout_s: float = 180.0
    """A rank waiting in one collective longer than this ends the job with every rank's phase; the process groups' own timeout is this plus two heartbeats."""

    def validate(self) -> None:
        if not 0.1 <= self.heartbeat_s <= 3600:
            raise ConfigError(f"watchdog.heartbeat_s = {self.heartbeat_s}: must lie in [0.1, 3600]")
        if not self.collective_timeout_s >= 2 * self.heartbeat_s:
            raise ConfigError(f"watchdog.collective_timeout_s = {self.collective_timeout_s}: must be at least two "
                              f"heartbeats ({2 * self.heartbeat_s:g} s)")


@dataclass
class FaultConfig:
    kind: str = "none"
    """Fault injection, for tests and benchmarks: `none`, `kill`, `hang`, `stall`, `exception`, `oom`, `nan`, `spike`, `corrupt_save` or `disk_full` (docs/reliability.md)."""
    step: int = 1
    """Step (1-based) at which the fault fires; for corrupt_save and disk_full, the checkpoint of that step."""
    rank: int = 0
    """Global rank that fails; -1 every rank at once (a preempted job); corrupt_save and disk_full act on the checkpoint as a whole."""
    every: int = 0
    """Repeat every N steps, the k-th time in the k-th attempt of a run restarted by --max-restarts; 0 fires once."""
    count: int = 1
    """Steps in a row a nan or spike fault lasts."""

    def validate(self) -> None:
        _positive("fault", self, "step", "count")
        _at_least("fault", self, -1, "rank")
        _at_least("fault", self, 0, "every")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline_parallel: PipelineParallelConfig = field(default_factory=PipelineParallelConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    gradient_comm: GradientCommConfig = field(default_factory=GradientCommConfig)
    parameter_server: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def validate(self, sections: tuple[str, ...] | None = None) -> "JobConfig":
        """Each section on its own (`sections`: only these, when the others are known valid), then the rules
        that tie sections together (fold name lists: parallel.validate)."""
        sections = SECTIONS if sections is None else sections
        for section in sections:
            _finite(section, getattr(self, section))
        for section in sections:
            validate = getattr(getattr(self, section), "validate", None)
            if validate is not None:
                validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len = {self.train.seq_len} exceeds model.max_seq_len = {self.model.max_seq_len}: "
                "lower train.seq_len or raise model.max_seq_len"
            )
        if self.fault.kind != "none" and self.fault.step > self.train.steps:
            raise ConfigError(f"fault.step = {self.fault.step} lies after the last step (train.steps = {self.train.steps}): "
                              "the fault would never fire")
        self.validate_data_parallel()
        self._validate_scatter_gather()
        self._validate_gradient_comm()
        self._validate_parameter_server()
        return self

    def validate_data_parallel(self) -> None:
        """The data-parallel rules across sections. They read only data_parallel, context_parallel.degree and
        pipeline_parallel.degree, so a layout search checks them once for every candidate sharing these."""
        dp = self.data_parallel
        if not dp.shard_optim and (dp.shard * self.context_parallel.degree) % dp.hpz_partition:
            raise ConfigError(f"data_parallel.hpz_partition = {dp.hpz_partition} must divide the ZeRO shard degree "
                              f"data_parallel.shard x context_parallel.degree = {dp.shard * self.context_parallel.degree}")
        if dp.zero_stage > 0 and dp.shard * self.context_parallel.degree < 2 and dp.shard_optim < 2:
            raise ConfigError(f"data_parallel.zero_stage = {dp.zero_stage} needs data_parallel.shard x "
                              "context_parallel.degree >= 2 ranks to shard over: raise data_parallel.shard "
                              "(or set data_parallel.shard_optim)")
        if self.pipeline_parallel.degree > 1 and (dp.shard_params > 1 or dp.shard_grads > 1):
            raise ConfigError(
                f"data_parallel.shard_params / shard_grads = {dp.shard_params} / {dp.shard_grads} with "
                f"pipeline_parallel.degree = {self.pipeline_parallel.degree}: sharded gradients and parameters are "
                "reduce-scattered and regathered per micro-batch backward, which the pipeline interleaves; leave them "
                "at 0 or 1 with pipelining (shard_optim may be set)")
        if self.pipeline_parallel.degree > 1 and dp.zero_stage > 1:
            raise ConfigError(
                f"data_parallel.zero_stage = {dp.zero_stage} with pipeline_parallel.degree = {self.pipeline_parallel.degree}: "
                "ZeRO-2/3 reduce-scatter (and ZeRO-3 regathers) per micro-batch backward, which the pipeline interleaves; "
                "use zero_stage 0 or 1 with pipelining (as DeepSpeed's pipeline engine does)"
            )

    def _validate_scatter_gather(self) -> None:
        tp = self.tensor_parallel
        if self.pipeline_parallel.scatter_gather and (tp.degree == 1 or tp.sequence_parallel):
            why = ("the stages' activations are whole on every rank of a tensor-parallel group of 1"
                   if tp.degree == 1 else "tensor_parallel.sequence_parallel already sends each rank's own sequence slice")
            raise ConfigError(f"pipeline_parallel.scatter_gather splits a stage's activation over its tensor-parallel "
                              f"ranks, but {why}: set tensor_parallel.degree > 1 without sequence_parallel, or leave "
                              "scatter_gather off")

    def _validate_gradient_comm(self) -> None:
        """Settings that a mode would ignore are errors, never silence."""
        comm, defaults, dp = self.gradient_comm, GradientCommConfig(), self.data_parallel
        changed = [f.name for f in dataclasses.fields(comm) if getattr(comm, f.name) != getattr(defaults, f.name)]
        ddp_only = [n for n in changed if n not in ("reduce_dtype", "node_size")]  # ZeRO reads these two as well
        if dp.mode == "ps" and changed:
            raise ConfigError(f"{', '.join('gradient_comm.' + n for n in changed)} shape DDP's gradient all-reduce; with "
                              "data_parallel.mode = ps workers push whole fp32 gradients to the servers: leave them at "
                              "their defaults")
        if dp.zero_stage > 0 and ddp_only:
            raise ConfigError(f"{', '.join('gradient_comm.' + n for n in ddp_only)} drive DDP's gradient buckets; with "
                              f"data_parallel.zero_stage = {dp.zero_stage} gradients are reduce-scattered by ZeRO per flat "
                              "group: set zero_stage = 0 or leave them at their defaults")
        if comm.slice_mb != defaults.slice_mb and comm.schedule != "priority":
            raise ConfigError("gradient_comm.slice_mb sizes the priority schedule's slices: set gradient_comm.schedule = "
                              "priority or leave slice_mb at its default")
        if comm.schedule == "priority":
            if self.pipeline_parallel.degree > 1 or comm.compression != "none":
                raise ConfigError("gradient_comm.schedule = priority re-orders DDP's dense bucket all-reduces: it needs "
                                  "pipeline_parallel.degree 1 and gradient_comm.compression none")
            if self.train.max_grad_norm > 0:
                raise ConfigError(
                    f"gradient_comm.schedule = priority updates each module as soon as its own gradients arrive; clipping "
                    f"by the global norm (train.max_grad_norm = {self.train.max_grad_norm}) needs all of them first: "
                    "set train.max_grad_norm = 0 or use schedule = fifo"
                )

    def _validate_parameter_server(self) -> None:
        ps, defaults = self.parameter_server, ParameterServerConfig()
        if self.data_parallel.mode == "ps" and self.checkpoint.async_save:
            raise ConfigError("checkpoint.async_save writes on a process group of the training ranks' own, which the "
                              "parameter-server ranks would have to create too: use synchronous saves with data_parallel.mode = ps")
        if self.data_parallel.mode != "ps":
            changed = [f.name for f in dataclasses.fields(ps) if getattr(ps, f.name) != getattr(defaults, f.name)]
            if changed:
                raise ConfigError(f"{', '.join('parameter_server.' + n for n in changed)} only apply with "
                                  "data_parallel.mode = ps: set the mode or remove them")
            return
        others = {"tensor_parallel.degree": self.tensor_parallel.degree, "context_parallel.degree": self.context_parallel.degree,
                  "pipeline_parallel.degree": self.pipeline_parallel.degree, "data_parallel.shard": self.data_parallel.shard,
                  "data_parallel.zero_stage": self.data_parallel.zero_stage + 1}
        used = [name for name, value in others.items() if value != 1]
        if used:
            raise ConfigError(f"data_parallel.mode = ps keeps whole models on the workers: set {', '.join(used)} to its "
                              "default (degrees and shard 1, zero_stage 0)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig))
