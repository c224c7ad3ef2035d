"""Run configuration: dataclasses, TOML loading, `--section.key value` overrides, validation.

One `JobConfig` drives everything (the trainer today; the planner and simulator later read
the same objects). Sources are applied in order: dataclass defaults, then the TOML file,
then command-line overrides. Every key is checked before any work starts: an unknown key
names the valid ones and the closest match; a bad value names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.presets import PRESETS, get_preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class DataConfig:
    source: str = "stdlib"
    """`stdlib` (the running interpreter's standard library source, the embedded default corpus)
    or a path to a .txt/.jsonl file or a folder of them (comma-separate several paths)."""
    tokenizer: str = "byte"
    """`byte` (256 byte values + end-of-text), `bpe` (trained locally on the train split) or a
    path to a saved `tokenizer.json`."""
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

    def validate(self) -> None:
        for name in ("steps", "seq_len", "micro_batch_size", "grad_accum_steps", "eval_batches", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} = {getattr(self, name)}: must be a positive integer")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every = {self.eval_every}: must be >= 0 (0 disables evaluation)")
        if self.max_grad_norm < 0:
            raise ConfigError(f"train.max_grad_norm = {self.max_grad_norm}: must be >= 0 (0 disables clipping)")
        _check_choice("train.dtype", self.dtype, ("fp32", "bf16"))
        _check_choice("train.device", self.device, ("auto", "cpu", "cuda"))


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
        if self.lr <= 0:
            raise ConfigError(f"optim.lr = {self.lr}: must be positive")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio = {self.min_lr_ratio}: must lie in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps = {self.warmup_steps}: must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name} = {getattr(self, name)}: must lie in [0, 1)")
        _check_choice("optim.schedule", self.schedule, ("cosine", "linear", "constant"))


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

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every = {self.every}: must be >= 0")
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last = {self.keep_last}: must be >= 1")


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
    """With parallel.pp > 1: write a Chrome trace of the last step's measured compute and communication per stage (<output_dir>/pipeline_trace.json)."""

    def validate(self) -> None:
        if self.sample_tokens < 0:
            raise ConfigError(f"logging.sample_tokens = {self.sample_tokens}: must be >= 0")


@dataclass
class ParallelConfig:
    dp_replicate: int = -1
    """Data-parallel replicas, each holding the whole model or a whole set of shards; -1 takes the ranks dp_shard leaves."""
    dp_shard: int = 1
    """Ranks the model states are sharded over with ZeRO (needs zero_stage >= 1); dp = dp_replicate x dp_shard."""
    zero_stage: int = 0
    """0: DDP (nothing sharded); 1: optimizer states; 2: + gradients; 3: + parameters (ZeRO)."""
    param_dtype: str = "fp32"
    """Compute weights with ZeRO: `fp32`, or `bf16` with fp32 master shards (mixed precision)."""
    offload: bool = False
    """ZeRO-Offload: keep fp32 masters and optimizer states on the CPU and run the step there."""
    bucket_mb: float = 25.0
    """DDP gradient bucket size in MiB: smaller starts communication earlier, larger sends fewer messages."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are all-reduced in: `fp32`, or `bf16` (half the bytes on the wire, less precise)."""
    allreduce_algorithm: str = "native"
    """How DDP buckets are summed: `native` (the backend's), a hand-written `ring`, `halving_doubling`, `rabenseifner`, `butterfly`, `tree`, `double_tree`, `hierarchical`, `torus`, or `auto` (the cost model's fastest per bucket, links measured at start)."""
    node_size: int = 0
    """Ranks per node for `hierarchical` and `auto`: 0 takes LOCAL_WORLD_SIZE; set it to split one machine into pretend nodes."""
    comm_schedule: str = "fifo"
    """Order of DDP gradient communication: `fifo` (buckets as backward fills them) or `priority` (slices in next-forward order, each module's update deferred to its next forward; needs train.max_grad_norm = 0)."""
    slice_mb: float = 1.0
    """With comm_schedule = priority: size of the slices buckets are cut into, in MiB."""
    compression: str = "none"
    """DDP gradient compression: `none`, `int8` (block quantised), `sign` (1 bit + scale, error feedback), `topk` (error feedback) or `powersgd` (low rank, error feedback)."""
    compression_block: int = 256
    """Values per scale for `int8` and `sign` (a multiple of 8)."""
    topk_ratio: float = 0.01
    """Fraction of each bucket's values `topk` sends."""
    powersgd_rank: int = 4
    """Rank r of the `powersgd` approximation of each weight matrix."""
    dp_mode: str = "ddp"
    """Data parallelism by all-reduce (`ddp`, with ZeRO when zero_stage > 0) or by parameter servers (`ps`: the last ps_servers ranks serve, the others work)."""
    ps_servers: int = 1
    """With dp_mode = ps: server ranks holding parameter shards and their optimizer."""
    ps_sync: str = "bsp"
    """With dp_mode = ps: `bsp` (synchronous, equals DDP), `asp` (asynchronous) or `ssp` (stale synchronous, bounded by ps_staleness)."""
    ps_staleness: int = 2
    """With ps_sync = ssp: the most steps a worker may run ahead of the slowest."""
    tp: int = 1
    """Tensor-parallel degree (Megatron): attention heads, MLP width and vocabulary split over tp ranks."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals run on 1/tp of the sequence (all-gather / reduce-scatter instead of all-reduce)."""
    recompute: str = "none"
    """Activation recomputation: `none`, `full` (each block's forward again in backward) or `selective` (attention core only)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over cp ranks (load-balanced causal chunks)."""
    cp_method: str = "ring"
    """Context-parallel attention: `ring` (K/V blocks passed around a ring), `ulysses` (all-to-all to heads) or `2d` (both)."""
    cp_heads: int = 2
    """With cp_method = 2d: the head-parallel (Ulysses) degree; the ring takes cp / cp_heads ranks."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are split by depth over pp ranks; train.grad_accum_steps micro-batches flow through them."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: `gpipe`, `1f1b`, `interleaved` (needs pp_virtual >= 2) or `zb-h1` (zero bubble)."""
    pp_virtual: int = 1
    """Virtual stages per pipeline rank (the interleaved schedule): pp x pp_virtual stages in all."""
    pp_layers_per_stage: list[int] = field(default_factory=list)
    """Blocks per stage, e.g. `3,4,4,3`, overriding the balanced split; empty = balance by pp_balance."""
    pp_balance: str = "flops"
    """Cost the stage split balances: `flops` (training FLOPs, head included) or `params` (parameters, embedding included)."""

    def validate(self) -> None:
        if self.dp_replicate == 0 or self.dp_replicate < -1:
            raise ConfigError(f"parallel.dp_replicate = {self.dp_replicate}: use a positive degree or -1 (all ranks)")
        if self.bucket_mb <= 0:
            raise ConfigError(f"parallel.bucket_mb = {self.bucket_mb}: must be positive")
        _check_choice("parallel.reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        self._validate_gradient_communication()
        self._validate_parameter_server()
        _check_choice("parallel.param_dtype", self.param_dtype, ("fp32", "bf16"))
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage = {self.zero_stage}: use 0 (DDP), 1, 2 or 3")
        if self.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard = {self.dp_shard}: must be a positive integer")
        if self.zero_stage == 0 and self.dp_shard > 1:
            raise ConfigError(f"parallel.dp_shard = {self.dp_shard} shards model states with ZeRO: set parallel.zero_stage to 1, 2 or 3")
        if self.zero_stage > 0 and self.dp_shard * self.cp < 2:
            raise ConfigError(f"parallel.zero_stage = {self.zero_stage} needs parallel.dp_shard x parallel.cp >= 2 ranks "
                              "to shard over: raise parallel.dp_shard")
        if self.zero_stage == 0 and (self.param_dtype != "fp32" or self.offload):
            raise ConfigError("parallel.param_dtype = bf16 and parallel.offload need ZeRO: set parallel.zero_stage >= 1")
        if self.tp < 1:
            raise ConfigError(f"parallel.tp = {self.tp}: must be a positive integer")
        _check_choice("parallel.recompute", self.recompute, ("none", "full", "selective"))
        for name in ("pp", "pp_virtual"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} = {getattr(self, name)}: must be a positive integer")
        _check_choice("parallel.pp_schedule", self.pp_schedule, ("gpipe", "1f1b", "interleaved", "zb-h1"))
        _check_choice("parallel.pp_balance", self.pp_balance, ("flops", "params"))
        if self.pp == 1 and (self.pp_virtual > 1 or self.pp_layers_per_stage):
            raise ConfigError("parallel.pp_virtual and parallel.pp_layers_per_stage split a pipeline: set parallel.pp > 1")
        if self.pp > 1 and self.zero_stage > 1:
            raise ConfigError(
                f"parallel.zero_stage = {self.zero_stage} with parallel.pp = {self.pp}: ZeRO-2/3 reduce-scatter (and "
                "ZeRO-3 regathers) per micro-batch backward, which the pipeline interleaves; use zero_stage 0 or 1 "
                "with pipelining (as DeepSpeed's pipeline engine does)"
            )

    def _validate_gradient_communication(self) -> None:
        from fivefold.comm.compression import CODECS
        from fivefold.comm.reducers import ALGORITHMS

        _check_choice("parallel.allreduce_algorithm", self.allreduce_algorithm, ALGORITHMS)
        _check_choice("parallel.compression", self.compression, CODECS)
        if self.zero_stage > 0 and (self.allreduce_algorithm != "native" or self.compression != "none"):
            raise ConfigError(
                "parallel.allreduce_algorithm and parallel.compression drive the DDP gradient buckets; with "
                f"parallel.zero_stage = {self.zero_stage} gradients are reduce-scattered by ZeRO: set zero_stage = 0 "
                "or leave them at native / none"
            )
        _check_choice("parallel.comm_schedule", self.comm_schedule, ("fifo", "priority"))
        if self.slice_mb <= 0:
            raise ConfigError(f"parallel.slice_mb = {self.slice_mb}: must be positive")
        if self.comm_schedule == "priority" and (self.zero_stage > 0 or self.pp > 1 or self.compression != "none"
                                                 or self.dp_mode != "ddp"):
            raise ConfigError("parallel.comm_schedule = priority re-orders DDP's dense bucket all-reduces: it needs "
                              "zero_stage 0, pp 1, compression none and dp_mode ddp")
        if self.node_size < 0:
            raise ConfigError(f"parallel.node_size = {self.node_size}: use 0 (LOCAL_WORLD_SIZE) or a positive rank count")
        if self.compression_block < 8 or self.compression_block % 8:
            raise ConfigError(f"parallel.compression_block = {self.compression_block}: must be a positive multiple of 8")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"parallel.topk_ratio = {self.topk_ratio}: must be in (0, 1]")
        if self.powersgd_rank < 1:
            raise ConfigError(f"parallel.powersgd_rank = {self.powersgd_rank}: must be >= 1")

    def _validate_parameter_server(self) -> None:
        _check_choice("parallel.dp_mode", self.dp_mode, ("ddp", "ps"))
        _check_choice("parallel.ps_sync", self.ps_sync, ("bsp", "asp", "ssp"))
        if self.ps_servers < 1:
            raise ConfigError(f"parallel.ps_servers = {self.ps_servers}: must be a positive integer")
        if self.ps_staleness < 0:
            raise ConfigError(f"parallel.ps_staleness = {self.ps_staleness}: must be >= 0")
        if self.dp_mode != "ps":
            return
        others = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp_shard": self.dp_shard, "zero_stage": self.zero_stage + 1}
        used = [name for name, value in others.items() if value != 1]
        if used:
            raise ConfigError(f"parallel.dp_mode = ps keeps whole models on the workers: set {', '.join('parallel.' + u for u in used)} "
                              "to its default (tp, cp, pp, dp_shard 1; zero_stage 0)")
        if self.allreduce_algorithm != "native" or self.compression != "none":
            raise ConfigError("parallel.allreduce_algorithm and parallel.compression drive DDP buckets; parameter servers "
                              "push and pull whole gradients: leave them at native / none with dp_mode = ps")

    def workers(self, world_size: int) -> int:
        """Ranks that train: all of them, or all but the parameter servers."""
        if self.dp_mode != "ps":
            return world_size
        if world_size <= self.ps_servers:
            raise ConfigError(f"parallel.ps_servers = {self.ps_servers} leaves no worker among {world_size} ranks: "
                              "start more ranks or use fewer servers")
        return world_size - self.ps_servers

    def dims(self, world_size: int):
        """The ParallelDims for a world of `world_size` ranks (validated: product == world size)."""
        from fivefold.parallel.mesh import ParallelDims

        world_size = self.workers(world_size)
        others = self.pp * self.dp_shard * self.cp * self.tp
        replicate = world_size // others if self.dp_replicate == -1 else self.dp_replicate
        return ParallelDims(dp_replicate=max(replicate, 1), dp_shard=self.dp_shard, cp=self.cp, tp=self.tp,
                            pp=self.pp, world_size=world_size)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "JobConfig":
        for section in SECTIONS:
            getattr(self, section).validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"train.seq_len = {self.train.seq_len} exceeds model.max_seq_len = {self.model.max_seq_len}: "
                "lower train.seq_len or raise model.max_seq_len"
            )
        from fivefold.parallel.context_parallel import check_context_parallel
        from fivefold.parallel.tensor_parallel import check_tensor_parallel

        par = self.parallel
        if par.comm_schedule == "priority" and self.train.max_grad_norm > 0:
            raise ConfigError(
                f"parallel.comm_schedule = priority updates each module as soon as its own gradients arrive; clipping by "
                f"the global norm (train.max_grad_norm = {self.train.max_grad_norm}) needs all of them first: "
                "set train.max_grad_norm = 0 or use comm_schedule = fifo"
            )
        check_context_parallel(self.model, par.cp, par.cp_method, par.cp_heads, par.tp, self.train.seq_len)
        # Tensor (and sequence) parallelism sees each context-parallel rank's part of the sequence.
        check_tensor_parallel(self.model, par.tp, par.sequence_parallel, self.train.seq_len // par.cp)
        if par.pp > 1:
            from fivefold.parallel.pipeline.stages import check_pipeline

            check_pipeline(self.model, par, self.train.seq_len, self.train.grad_accum_steps)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = tuple(f.name for f in dataclasses.fields(JobConfig))
PRESET_KEY = "preset"


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(choices)}{_did_you_mean(value, choices)}")


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, raw: Any, annotation: Any) -> Any:
    """Convert a TOML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin is list:
        items = [x for x in raw.replace(" ", "").split(",") if x] if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key} = {raw!r}: expected a list, e.g. 1,2,3")
        (item_type,) = typing.get_args(annotation)
        return [_coerce(key, item, item_type) for item in items]
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        return _coerce(key, raw, args[0])
    try:
        if annotation is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(raw, str) and raw.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.replace("_", ""))
        if annotation is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if annotation is str:
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
    except ValueError:
        pass
    else:
        raise ConfigError(f"{key}: unsupported field type {annotation}")  # pragma: no cover
    kind = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{key} = {raw!r}: expected {kind}")


def _apply_section(cfg: JobConfig, section: str, values: dict[str, Any], source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section [{section}] in {source}; valid sections: {', '.join(SECTIONS)}"
            f"{_did_you_mean(section, SECTIONS)}"
        )
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] in {source} must be a table of key = value pairs")
    current = getattr(cfg, section)
    values = {k.replace("-", "_"): v for k, v in values.items()}
    if section == "model" and PRESET_KEY in values:
        name = values.pop(PRESET_KEY)
        if name not in PRESETS:
            raise ConfigError(
                f"model.preset = {name!r} is unknown; valid presets: {', '.join(PRESETS)}{_did_you_mean(str(name), PRESETS)}"
            )
        current = get_preset(name)
    hints = _field_types(type(current))
    valid = [f.name for f in dataclasses.fields(current)] + ([PRESET_KEY] if section == "model" else [])
    updates = {}
    for key, raw in values.items():
        if key not in hints:
            raise ConfigError(
                f"unknown key {section}.{key} in {source}; valid keys of [{section}]: {', '.join(valid)}"
                f"{_did_you_mean(key, valid)}"
            )
        updates[key] = _coerce(f"{section}.{key}", raw, hints[key])
    setattr(cfg, section, dataclasses.replace(current, **updates))


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """Turn `--section.key value` / `--section.key=value` pairs into {section: {key: value}}."""
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE (e.g. --train.steps 100)")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value: write {arg} VALUE")
            name, value = arg[2:], args[i + 1]
            i += 2
        section, key = name.split(".", 1)
        out.setdefault(section.replace("-", "_"), {})[key.replace("-", "_")] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then `--section.key value` overrides; validated."""
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
        for section, values in data.items():
            _apply_section(cfg, section, values, str(path))
    for section, values in parse_overrides(overrides or []).items():
        _apply_section(cfg, section, values, "command-line overrides")
    return cfg.validate()


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Rebuild a JobConfig saved with `to_dict` (e.g. from a checkpoint)."""
    cfg = JobConfig()
    for section, values in data.items():
        _apply_section(cfg, section, dict(values), "saved config")
    return cfg.validate()


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (torchtitan style), read from source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            is_doc = isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant)
            docs[node.target.id] = " ".join(following.value.value.split()) if is_doc else ""
    return docs


def describe_config() -> str:
    """Markdown reference of every config key: type, default and meaning (docs/configuration.md)."""
    defaults = JobConfig()
    lines = [
        "# Configuration reference",
        "",
        "Generated by `fivefold config --reference` from the field docstrings in the code.",
        "Set keys in a TOML file (`[section]` tables) or on the command line as `--section.key VALUE`;",
        "the command line wins. `[model] preset = NAME` starts from a preset; other model keys then override it.",
    ]
    for section in SECTIONS:
        current = getattr(defaults, section)
        hints = _field_types(type(current))
        docs = _field_docs(type(current))
        lines += ["", f"## [{section}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        if section == "model":
            lines.append(f"| preset | str | tiny | start from a preset: {', '.join(PRESETS)} |")
        for f in dataclasses.fields(current):
            kind = str(hints[f.name]) if typing.get_origin(hints[f.name]) else getattr(hints[f.name], "__name__", "")
            lines.append(f"| {f.name} | {kind} | {getattr(current, f.name)!r} | {docs.get(f.name, '')} |")
    return "\n".join(lines) + "\n"
