"""Measured compute profiles: a model's passes timed on one accelerator, for the planner and the simulator.

The step-time model prices a block's forward from its FLOPs at an achieved share of peak, the bytes it
writes at the memory bandwidth and a fixed host cost (plan/estimate.py `pass_costs`). A profile replaces
those guesses with measurements of the runtime's own modules: `fivefold bench compute`
(plan/profile_measure.py) builds the job's model (model/llama.py), feeds one dense block and one MoE block (where the model has them) a
micro-batch of the job's shape, and times their forward and backward passes, the attention core
alone and the head with the loss (`measure_profile`), keeping a third of each (the planner prices a
forward and twice it for backward, so a measured pass pair is priced whole). Planning or simulating with `--profile FILE` then prices each
of these as measured, scaled to the layout by the model's own ratio: the modelled seconds of the
rank's shard over the modelled seconds of what was measured (plan/estimate.py `profiled_costs`), so a tensor-parallel
rank's block costs its measured block times the share of the work the model gives it. At the
profiled shape on one rank the priced passes are the measured ones exactly; elsewhere the model
carries them.

A profile is JSON (no code runs on load) naming the model's dimensions, the dtype, whether the passes were
compiled (train.compile), the head's chunk (train.loss_chunk_tokens), the MoE block's expert kernel
(expert_parallel.kernel as resolved) and the shape it was measured at; one for another model, dtype,
compilation, head or expert kernel is refused with the mismatch named.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import ConfigError

FORMAT = "fivefold-compute-profile/1"
# what a profile must agree on with the job it prices (model/config.py fields)
MODEL_KEYS = ("dim", "n_heads", "kv_heads", "head_size", "ffn_hidden_dim", "attention", "n_experts", "moe_top_k",
              "expert_hidden_dim", "shared_hidden_dim", "vocab_size")


@dataclass(frozen=True)
class ComputeProfile:
    """Measured seconds of one micro-batch's pass on one accelerator, a third of its forward and backward (the
    planner's forward, backward priced at twice it): a dense block and a MoE block (0 where the model has
    none), the attention core within a block, and the head with its loss."""

    model: dict
    dtype: str
    micro_batch_size: int
    seq_len: int
    block: float
    moe_block: float
    core: float
    head: float
    threads: int = 0
    device: str = ""
    compiled: bool = False  # measured under train.compile (compiled blocks and loss)
    loss_chunk_tokens: int = 0  # the head measured as train.loss_chunk_tokens runs it (0: the plain head)
    expert_kernel: str = ""  # the MoE block's experts as measured, `grouped` or `loop` ("": no MoE block)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=2) + "\n"

    def check_model(self, model, dtype: str, compiled: bool = False, loss_chunk_tokens: int = 0,
                    expert_kernel: str = "") -> None:
        """ConfigError naming what differs when this profile was measured on another model, dtype, compilation,
        head or expert kernel (eager passes priced a compiled 1B step 43% long on an H200, and the loop kernel's
        MoE step took 2.9 times the grouped one's, docs/planner.md)."""
        wrong = [f"model.{k} {self.model.get(k)!r} (profile) vs {getattr(model, k)!r}" for k in MODEL_KEYS
                 if self.model.get(k) != getattr(model, k)]
        if dtype != self.dtype:
            wrong.append(f"compute dtype {self.dtype} (profile) vs {dtype}")
        if compiled != self.compiled:
            wrong.append(f"train.compile {str(self.compiled).lower()} (profile) vs {str(compiled).lower()}")
        if loss_chunk_tokens != self.loss_chunk_tokens:
            wrong.append(f"train.loss_chunk_tokens {self.loss_chunk_tokens} (profile) vs {loss_chunk_tokens}")
        if self.expert_kernel and expert_kernel and expert_kernel != self.expert_kernel:
            wrong.append(f"expert_parallel.kernel {self.expert_kernel} (profile) vs {expert_kernel}")
        if wrong:
            raise ConfigError("--profile was measured for another model: " + "; ".join(wrong)
                              + " (measure this one: fivefold bench compute with the job's config)")


def load_profile(path: str) -> ComputeProfile:
    """A profile written by `fivefold bench compute` (JSON, validated field by field)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--profile {path}: no such file (`fivefold bench compute --out FILE` writes one)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--profile {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
        raise ConfigError(f"--profile {path}: not a {FORMAT} file")
    known = {f.name for f in dataclasses.fields(ComputeProfile)}
    if not known - {"threads", "device", "compiled", "loss_chunk_tokens", "expert_kernel"} <= set(data) <= known:  # optional keys
        raise ConfigError(f"--profile {path}: expected the keys {', '.join(sorted(known))}; found {', '.join(sorted(data))}")
    if data["dtype"] not in ("fp32", "bf16"):
        raise ConfigError(f"--profile {path}: dtype = {data['dtype']!r} must be fp32 or bf16")
    for key in ("threads", "loss_chunk_tokens"):
        value = data.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"--profile {path}: {key} = {value!r} must be a non-negative integer")
    if not isinstance(data.get("compiled", False), bool):
        raise ConfigError(f"--profile {path}: compiled = {data['compiled']!r} must be true or false")
    if data.get("expert_kernel", "") not in ("", "grouped", "loop"):
        raise ConfigError(f"--profile {path}: expert_kernel = {data['expert_kernel']!r} must be grouped or loop")
    if not isinstance(data.get("device", ""), str):
        raise ConfigError(f"--profile {path}: device = {data['device']!r} must be a string")
    for key in ("block", "moe_block", "core", "head"):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"--profile {path}: {key} = {value!r} must be a non-negative number of seconds")
    for key in ("micro_batch_size", "seq_len"):
        if isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 1:
            raise ConfigError(f"--profile {path}: {key} = {data[key]!r} must be a positive integer")
    if not isinstance(data["model"], dict) or set(data["model"]) != set(MODEL_KEYS):
        raise ConfigError(f"--profile {path}: model must name {', '.join(MODEL_KEYS)}")
    return ComputeProfile(**data)
