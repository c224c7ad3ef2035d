"""Model-state memory (parameters, gradients, optimizer states) per the ZeRO paper's accounting.

Rajbhandari et al. 2020: mixed-precision Adam keeps 2 bytes of half-precision parameters,
2 of half-precision gradients and K = 12 of fp32 master parameters, momentum and variance
per parameter: 16 bytes per parameter. Plain fp32 Adam keeps 4 + 4 + 8 = 16 as well, but
split differently (no master copy). Sharded variants (ZeRO-1/2/3) are added with data parallelism.
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
