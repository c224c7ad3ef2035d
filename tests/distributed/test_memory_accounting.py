"""Measured model-state bytes per rank == the ZeRO formulas, up to padding, for every stage and precision."""

import pytest

from fivefold.train.trainer import Trainer

from distributed.spawn import run_distributed
from parity.harness import with_changes

# (stage, weights, offload: False, True (host memory) or "nvme" (the host keeps the slot ring, parallel/nvme_offload.py))
NVME_SUB_GROUP = 256
VARIANTS = ([(0, "fp32", False)] + [(s, d, False) for s in (1, 2, 3) for d in ("fp32", "bf16")]
            + [(3, "bf16", True), (3, "fp32", True), (2, "bf16", "nvme")])


def _measure(rank, world_size, configs):
    out = []
    for config in configs:
        trainer = Trainer(config)
        trainer.train_step()
        zero = getattr(trainer.sync, "zero", None)
        groups = len(zero.groups) if zero else 0
        out.append((tuple(trainer.report.model_state_bytes.__dict__.values()),
                    tuple(trainer.report.expected_model_states().__dict__.values()), groups))
        trainer.close()
    return out


def _configs(job, tmp_path, world_size):
    configs = []
    for stage, dtype, offload in VARIANTS:
        data_parallel = {"zero_stage": stage, "shard": world_size if stage else 1, "param_dtype": dtype,
                         "offload": bool(offload), "nvme_path": str(tmp_path) if offload == "nvme" else "",
                         "nvme_sub_group": NVME_SUB_GROUP}
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
            if offload == "nvme":  # pieces of 256 elements: 3 slots x 3 states x one page each, not the largest group's
                assert measured[2] == 3 * 3 * 4096


MOE = dict(n_experts=4, moe_top_k=2, moe_ffn_dim=32, moe_shared_experts=1)
MOE_LAYOUTS = {  # name -> (world, ep, etp, zero stage, precision)
    "ep2-ddp": (2, 2, 1, 0, "fp32"),
    "ep2-zero1-edp2": (4, 2, 1, 1, "fp32"),
    "ep2-zero3-edp2-bf16": (4, 2, 1, 3, "bf16"),
    "ep2xetp2-ddp": (4, 2, 2, 0, "fp32"),
    "etp2-zero2-edp2": (4, 1, 2, 2, "fp32"),
}


def _measure_moe(rank, world_size, config):
    from fivefold.plan.flops import count_parameters

    trainer = Trainer(config)
    trainer.train_step()
    groups = sum(len(z.groups) for z in getattr(trainer.sync, "zeros", []))
    count = count_parameters(trainer.model_config)  # the vocabulary comes from the tokenizer
    return (count, trainer.parallel.parameters, tuple(trainer.report.model_state_bytes.__dict__.values()), groups)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_model_states_per_rank_equal_the_formula(job, tmp_path, name):
    """Ψ per rank = Ψ - Ψ_e + Ψ_e / (EP x ETP), and the measured model states equal plan/memory.py's
    moe_model_states (dense states over the dp shards, experts' over EDP), up to ZeRO's padding."""
    from fivefold.plan.memory import moe_model_states, moe_parameters_per_rank

    world, ep, etp, stage, dtype = MOE_LAYOUTS[name]
    config = with_changes(job, model=MOE, checkpoint={"enabled": False},
                          train={"eval_every": 0, "micro_batch_size": 1, "output_dir": str(tmp_path / name)},
                          data_parallel={"zero_stage": stage, "shard": world if stage else 1, "param_dtype": dtype},
                          expert_parallel={"degree": ep, "tensor": etp})
    for count, parameters, measured, groups in run_distributed(_measure_moe, world, config):
        assert count.routed_experts == 2 * 4 * 3 * config.model.dim * 32  # 2 MoE layers x 4 experts x SwiGLU
        assert parameters == moe_parameters_per_rank(count.total, count.routed_experts, ep, etp)
        expected = moe_model_states(count.total, count.routed_experts, ep, etp, stage, world, world // (ep * etp),
                                    dtype == "bf16")
        slack = groups * (world - 1) * 16  # ZeRO pads each flat group to a multiple of its shard count
        for label, m, e in zip(("parameters", "gradients", "optimizer"), measured, expected.__dict__.values()):
            assert e <= m <= e + slack, f"{name} {label}: measured {m}, formula {e}"
        if stage == 0:
            assert measured == tuple(expected.__dict__.values())
