"""The compute model's achieved shares of an accelerator's peak FLOP/s (the planner's and the simulator's).

Two numbers, because two kinds of matmul run at different distances from peak: the projections, the
MLP and the head are large GEMMs (K and N of the order of the hidden size), while the attention core,
softmax(q k^T / sqrt(d)) v, multiplies by the head dimension (64 to 160) and has the softmax between
its two matmuls, so it reaches a smaller share of peak, fused (FlashAttention) or not. Its share of a
block's FLOPs is s / 6h, so one efficiency for both makes narrow models look as fast as wide ones;
Megatron-LM's published rates rise from 137 to 163 teraFLOP/s per A100 as h grows from 2,304 to
25,600 (docs/simulator.md, "Against published runs").

The width law (`half_width` > 0) replaces both numbers' fixed shares by one curve: a GEMM whose weight slice
on one rank is K x N reaches `matmul` x n / (n + half_width) of peak, n = min(K, N) (plan/gemms.py). Wide GEMMs approach `matmul`; tensor parallelism's narrower slices and the attention core's head
dimension fall below it, so one curve covers the projections, the MLP, the head and the core (unless
`attention` still sets the core's share).

A third share, `experts`, is the routed experts' GEMMs' in a mixture-of-experts block (0: the same as the
other matmuls, or by the width law). Each expert multiplies only the few rows routed to it (k x tokens / E),
and a grouped kernel loops over the experts or stacks their weights first; on this repository's CPU host the
runtime's grouped GEMM with its stack ran at 0.61-0.67 of a large matmul's rate (docs/planner.md), so one
share for all matmuls prices a MoE block's routed work short.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fivefold.errors import ConfigError


@dataclass(frozen=True)
class Efficiency:
    """matmul: achieved share of peak in the projections, MLP and head (with the width law: in a GEMM of
    unbounded width); attention: in the attention core (0: the same as matmul, or by the width law);
    half_width: the weight slice's narrower side (min(K, N) per rank) at which a matmul reaches half of
    `matmul` (0: no width law); experts: in the routed experts' GEMMs of a MoE block (0: the same as matmul,
    or by the width law)."""

    matmul: float = 0.5
    attention: float = 0.0
    # measured forward passes (plan/profile.py ComputeProfile) that replace the modelled ones, scaled to each layout
    profile: object | None = None
    half_width: float = 0.0
    experts: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.matmul <= 1:
            raise ConfigError(f"efficiency = {self.matmul}: the achieved share of peak FLOP/s must lie in (0, 1]")
        if not 0 <= self.attention <= 1:
            raise ConfigError(f"attention efficiency = {self.attention}: the attention core's achieved share of "
                              "peak FLOP/s must lie in (0, 1] (0: the same as the matmuls')")
        if not 0 <= self.experts <= 1:
            raise ConfigError(f"expert efficiency = {self.experts}: the routed experts' achieved share of peak "
                              "FLOP/s must lie in (0, 1] (0: the same as the matmuls')")
        if not (0 <= self.half_width < float("inf")):
            raise ConfigError(f"half width = {self.half_width}: the GEMM width at which a matmul reaches half its "
                              "share must be a finite number >= 0 (0: no width law)")

    def share(self, narrowest: float) -> float:
        """The achieved share of peak of a GEMM whose weight slice's narrower side is `narrowest`."""
        if not self.half_width:
            return self.matmul
        return self.matmul * narrowest / (narrowest + self.half_width)

    def core_share(self, narrowest: float) -> float:
        """The attention core's share: `attention` when set, else the width law at the head dimension."""
        return self.attention or (self.share(narrowest) if self.half_width else self.matmul)

    def expert_share(self, narrowest: float) -> float:
        """A routed expert GEMM's share: `experts` when set, else the other matmuls' (by the width law if set)."""
        return self.experts or self.share(narrowest)

    def describe(self) -> str:
        if self.profile is not None:
            return f"measured passes ({self.profile.device}, micro-batch {self.profile.micro_batch_size} x " \
                   f"{self.profile.seq_len}), carried to the layout by the model at {self.matmul:g}"
        width = f", half at GEMM width {self.half_width:g}" if self.half_width else ""
        parts = [f"attention core {self.attention:g}" if self.attention else "",
                 f"routed experts {self.experts:g}" if self.experts else ""]
        inner = ", ".join(part for part in parts if part)
        return f"{self.matmul:g}" + (f" ({inner})" if inner else "") + width


def as_efficiency(value: float | Efficiency) -> Efficiency:
    """A bare number is one share for every matmul."""
    return value if isinstance(value, Efficiency) else Efficiency(float(value))


def add_efficiency_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--efficiency, --attention-efficiency, --expert-efficiency, --half-width and --profile, as `fivefold plan` and `fivefold simulate` take them."""
    parser.add_argument("--efficiency", type=float, default=0.5,
                        help="achieved share of peak FLOP/s in the blocks' matmuls (default 0.5)")
    parser.add_argument("--attention-efficiency", type=float, default=0.0,
                        help="achieved share of peak FLOP/s in the attention core, softmax(q k^T) v, which runs "
                             "further from peak than the large matmuls (default: the same as --efficiency, or by "
                             "--half-width)")
    parser.add_argument("--expert-efficiency", type=float, default=0.0,
                        help="achieved share of peak FLOP/s in a MoE block's routed expert GEMMs, which multiply "
                             "few rows each (default: the same as --efficiency, or by --half-width)")
    parser.add_argument("--half-width", type=float, default=0.0,
                        help="the width law: a matmul whose weight slice on a rank is K x N runs at "
                             "efficiency x n / (n + HALF_WIDTH) of peak, n = min(K, N) (default 0: every matmul "
                             "at --efficiency)")
    parser.add_argument("--profile", default=None,
                        help="measured forward passes of this model (`fivefold bench compute --out FILE`): they "
                             "replace the modelled compute, scaled to the layout by the model (docs/planner.md)")


def efficiency_from(args: argparse.Namespace) -> Efficiency:
    """The shares the command line gave (a one-line ConfigError for nan, inf or out of range)."""
    profile = None
    if getattr(args, "profile", None):
        from fivefold.plan.profile import load_profile

        profile = load_profile(args.profile)
    return Efficiency(args.efficiency, args.attention_efficiency, profile, getattr(args, "half_width", 0.0),
                      getattr(args, "expert_efficiency", 0.0))
