"""Model-state memory (parameters, gradients, optimizer states) per the ZeRO paper's accounting.

Rajbhandari et al. 2020: mixed-precision Adam keeps 2 bytes of half-precision parameters,
2 of half-precision gradients and K = 12 of fp32 master parameters, momentum and variance
per parameter: 16 bytes per parameter. Plain fp32 Adam keeps 4 + 4 + 8 = 16 as well, but
split differently (the weights are their own master). ZeRO over N ranks divides by N:
    stage 1: optimizer states      mixed 2 + 2 + 12/N     fp32 4 + 4 + 8/N
    stage 2: + gradients           mixed 2 + 14/N         fp32 4 + 12/N
    stage 3: + parameters          mixed 16/N             fp32 16/N
(ZeRO paper, 7.5B parameters at N = 64: 120, 31.4, 16.6 and 1.9 GB.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def adam_fp32(num_params: int) -> ModelStateBytes:
    """fp32 parameters (4), fp32 gradients (4), Adam momentum and variance (4 + 4)."""
    return ModelStateBytes(4 * num_params, 4 * num_params, 8 * num_params)


def adam_mixed_precision(num_params: int) -> ModelStateBytes:
    """bf16/fp16 parameters (2) and gradients (2); fp32 master, momentum, variance (K = 12)."""
    return ModelStateBytes(2 * num_params, 2 * num_params, 12 * num_params)


def zero_model_states(num_params: int, stage: int, shards: int, mixed_precision: bool) -> ModelStateBytes:
    """Bytes one rank holds under ZeRO `stage` (0 = plain data parallelism) over `shards` ranks."""
    weight = 2 if mixed_precision else 4
    optimizer = (12 if mixed_precision else 8) * num_params
    params, grads = weight * num_params, weight * num_params
    if stage >= 1:
        optimizer //= shards
    if stage >= 2:
        grads //= shards
    if stage >= 3:
        params //= shards
    return ModelStateBytes(params, grads, optimizer)
