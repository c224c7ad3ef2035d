"""How long a training run takes, or how many accelerators it needs: total FLOPs over the achieved rate.

    total FLOPs  = tokens x (6 N_matmul + 12 L H Q T)          (plan/flops.py, PaLM appendix B)
    days         = total FLOPs / (GPUs x achieved FLOP/s per GPU) / 86,400
    GPUs         = total FLOPs / (days x 86,400 x achieved FLOP/s per GPU)

The achieved rate is given (TFLOP/s per GPU, or an MFU of the cluster's peak) or predicted by the
planner for a layout (its tokens per second). Narayanan et al. (SC21) count 8 N T with full
recomputation (a second forward); model FLOPs here count 6, the work the model needs, as MFU does.
Their worked example: GPT-3 175B on 300B tokens at 160 TFLOP/s per GPU takes about 30 days on
about 800 GPUs (docs/planner.md reproduces it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.plan.flops import count_parameters, flops_per_token

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class Budget:
    tokens: float
    flops: float  # model FLOPs of the whole run
    achieved_flops_per_gpu: float
    gpus: float
    days: float

    def describe(self) -> str:
        return (f"{self.tokens:.3g} tokens x {self.flops / self.tokens:.4g} FLOPs/token = {self.flops:.4g} FLOPs; at "
                f"{self.achieved_flops_per_gpu / 1e12:.1f} TFLOP/s per GPU: {self.gpus:,.0f} GPUs for {self.days:,.1f} days "
                f"({self.gpus * self.days * 24:,.0f} GPU-hours)")


def training_flops(model: ModelConfig, tokens: float, seq_len: int) -> float:
    return flops_per_token(model, seq_len) * tokens


def budget(model: ModelConfig, tokens: float, seq_len: int, achieved_flops_per_gpu: float, gpus: float = 0,
           days: float = 0) -> Budget:
    """Days for `gpus`, or GPUs (rounded up) for `days`: give exactly one."""
    if (gpus > 0) == (days > 0):
        raise ConfigError("the calculator needs exactly one of --gpus and --days")
    if not (math.isfinite(gpus) and math.isfinite(days)):
        raise ConfigError(f"--gpus = {gpus}, --days = {days}: give a finite number")
    for name, value in (("--tokens", tokens), ("the achieved rate", achieved_flops_per_gpu)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} = {value}: must be a positive number")
    flops = training_flops(model, tokens, seq_len)
    gpu_seconds = flops / achieved_flops_per_gpu
    if gpus > 0:
        return Budget(tokens, flops, achieved_flops_per_gpu, gpus, gpu_seconds / gpus / SECONDS_PER_DAY)
    return Budget(tokens, flops, achieved_flops_per_gpu, math.ceil(gpu_seconds / (days * SECONDS_PER_DAY)), days)


def six_nt(model: ModelConfig, tokens: float) -> float:
    """The 6 N T rule of thumb (Kaplan et al. 2020), with N the parameters a token multiplies by."""
    return 6 * count_parameters(model).matmul * tokens
