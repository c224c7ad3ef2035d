"""Parity harness: train config A and config B from the same seed and data, compare every loss and parameter.

`train_single(config)` runs in this process; `train_distributed(config, world_size)` spawns gloo
ranks that each run the same Trainer. Both return (losses, final full state dict). The global
batch is the same by construction (the sampler slices one global batch per step), so the
two runs must agree up to floating-point summation order.

Tolerances (fp32): losses rtol 1e-5; parameters atol 1e-5 with rtol 1e-5 after Adam (Adam's
m / sqrt(v) can turn last-bit differences of near-zero gradients into differences up to ~lr
on a few elements; the tests use lr 1e-2). Tensor parallelism changes the summation order
inside every matmul (row-parallel layers add t partial products), so a few elements of the
MLP weights land up to 2e-5 away after 4 steps (2 of 41,184 at tp 4): its parameter tolerance
is TP_PARAM_ATOL = 1e-4, its loss tolerance the same rtol 1e-5. Context parallelism changes the
order of the attention sums (ring attention merges per-block softmax results) and sums weight
gradients over cp partial sequences; the largest parameter difference seen after 4 steps is
1.1e-5 (ring, cp 2; 2.3e-5 with the einsum block kernel), so it shares that tolerance
(CP_PARAM_ATOL), and the losses agree to 1e-7.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fivefold.config import JobConfig
from fivefold.train.checkpoint import read_weights
from fivefold.train.roles import run
from fivefold.train.trainer import Trainer

from distributed.spawn import run_distributed

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
TP_PARAM_ATOL = 1e-4
CP_PARAM_ATOL = TP_PARAM_ATOL


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return read_weights(checkpoint)


def _rank_main(rank: int, world_size: int, config: JobConfig) -> tuple[list[float], str | None]:
    result = run(config)
    return result.losses, str(result.checkpoint) if result.checkpoint else None


def train_single(config: JobConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    result = Trainer(config).fit()
    return result.losses, _weights(result.checkpoint)


def train_distributed(config: JobConfig, world_size: int, timeout: float = 150.0):
    results = run_distributed(_rank_main, world_size, config, timeout=timeout)
    losses = [r[0] for r in results]
    assert all(rank_losses == losses[0] for rank_losses in losses), "ranks disagree on the logged loss"
    return losses[0], _weights(Path(results[0][1]))


EXPERT_LOAD = "<expert-load>"  # expert_parallel.load_from in a layout table: replaced by `with_expert_load`


def with_expert_load(config: JobConfig, folder: Path, load: list[float] | None = None) -> JobConfig:
    """`config` with expert_parallel.load_from = EXPERT_LOAD pointed at a metrics.jsonl written into `folder` whose
    every MoE layer measured `load` (default: expert 0 hot, for EPLB's replicas); other configs unchanged."""
    import json

    if config.expert_parallel.load_from != EXPERT_LOAD:
        return config
    load = load or [900.0] + [100.0 / (e + 1) for e in range(config.model.n_experts - 1)]
    folder.mkdir(parents=True, exist_ok=True)
    record = {"step": 1, "moe_load": {str(layer): load for layer in config.model.moe_layers}}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return with_changes(config, expert_parallel={"load_from": str(folder)})


def with_changes(config: JobConfig, **sections) -> JobConfig:
    """A copy of config with some fields of some sections replaced: with_changes(c, train={"steps": 3})."""
    out = dataclasses.replace(config)
    for section, changes in sections.items():
        setattr(out, section, dataclasses.replace(getattr(out, section), **changes))
    return out.validate()


def assert_parity(a, b, loss_rtol: float = LOSS_RTOL, param_atol: float = PARAM_ATOL) -> dict[str, float]:
    """Compare (losses, state) pairs; return the largest differences seen."""
    (losses_a, state_a), (losses_b, state_b) = a, b
    assert len(losses_a) == len(losses_b)
    loss_diff = max(abs(x - y) / abs(x) for x, y in zip(losses_a, losses_b))
    assert loss_diff <= loss_rtol, f"losses differ: {losses_a} vs {losses_b}"
    assert state_a.keys() == state_b.keys()
    param_diff = 0.0
    for name in state_a:
        torch.testing.assert_close(state_a[name], state_b[name], rtol=1e-5, atol=param_atol, msg=name)
        param_diff = max(param_diff, (state_a[name] - state_b[name]).abs().max().item())
    return {"loss_rel": loss_diff, "param_abs": param_diff}
