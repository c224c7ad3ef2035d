"""Measured model-state bytes per rank == the ZeRO formulas, up to padding, for every stage and precision."""

import pytest

from fivefold.train.trainer import Trainer

from distributed.spawn import run_distributed
from parity.harness import with_changes

VARIANTS = [(0, "fp32", False)] + [(s, d, False) for s in (1, 2, 3) for d in ("fp32", "bf16")] + [(3, "bf16", True)]


def _measure(rank, world_size, configs):
    out = []
    for config in configs:
        trainer = Trainer(config)
        trainer.train_step()
        zero = getattr(trainer.sync, "zero", None)
        groups = len(zero.groups) if zero else 0
        out.append((tuple(trainer.report.model_state_bytes.__dict__.values()),
                    tuple(trainer.report.expected_model_states().__dict__.values()), groups))
    return out


def _configs(job, tmp_path, world_size):
    configs = []
    for stage, dtype, offload in VARIANTS:
        data_parallel = {"zero_stage": stage, "shard": world_size if stage else 1, "param_dtype": dtype, "offload": offload}
        configs.append(with_changes(job, data_parallel=data_parallel, checkpoint={"enabled": False},
                                    train={"eval_every": 0, "output_dir": str(tmp_path / f"{stage}{dtype}{offload}")}))
    return configs


@pytest.mark.parametrize("world_size", [2, 4])
def test_measured_equals_formula_up_to_padding(job, tmp_path, world_size):
    results = run_distributed(_measure, world_size, _configs(job, tmp_path, world_size))
    for rank_results in results:
        for (stage, dtype, offload), (measured, expected, groups) in zip(VARIANTS, rank_results):
            # each flat group pads to a multiple of N: at most N - 1 extra elements of <= 16 bytes of state
            slack = groups * (world_size - 1) * 16
            for name, m, e in zip(("parameters", "gradients", "optimizer"), measured, expected):
                assert e <= m <= e + slack, f"ZeRO-{stage} {dtype} offload={offload} {name}: measured {m}, formula {e}"
            if stage == 0:
                assert measured == expected
