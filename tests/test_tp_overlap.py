"""Collective matmuls (tensor_parallel.comm_overlap) without a process group: where the config refuses
them, what the planner makes of them, and the exposed-communication clock they are measured with."""

import dataclasses
import time

import pytest

from fivefold.config import JobConfig
from fivefold.errors import ConfigError
from fivefold.model import ModelConfig
from fivefold.reliability.activity import blocked_seconds, phase


@pytest.mark.parametrize("tensor, model, message", [
    ({"degree": 2, "comm_overlap": True}, {}, "sequence_parallel = true"),
    ({"degree": 1, "sequence_parallel": False, "comm_overlap": True}, {}, "sequence_parallel = true"),
    ({"degree": 2, "sequence_parallel": True, "comm_overlap": True}, {"norm_position": "post"}, "norm_position"),
])
def test_config_refuses_comm_overlap_where_it_cannot_work(tensor, model, message):
    from fivefold.parallel.validate import check_config

    config = JobConfig()
    config.tensor_parallel = dataclasses.replace(config.tensor_parallel, **tensor)
    config.model = dataclasses.replace(ModelConfig(name="m", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                   vocab_size=100, max_seq_len=256), **model)
    with pytest.raises(ConfigError, match=message):
        check_config(config.validate())


def _tp_seconds(overlap: bool, seq_len: int) -> float:
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate

    config = JobConfig()
    config.model = ModelConfig(name="plan", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                               max_seq_len=seq_len)
    config.train = dataclasses.replace(config.train, seq_len=seq_len, micro_batch_size=1, dtype="bf16")
    config.tensor_parallel = dataclasses.replace(config.tensor_parallel, degree=8, sequence_parallel=True,
                                                 comm_overlap=overlap)
    return estimate(config.validate(), 8, PRESETS["h100-sxm"], 0.4, simulate=False).time.tp


def test_the_planner_hides_the_rings_behind_their_matmuls():
    plain, overlapped = _tp_seconds(False, 4096), _tp_seconds(True, 4096)
    assert 0 <= overlapped < plain / 2  # NVLink steps are shorter than 1/8 of each matmul: mostly hidden


def test_blocked_seconds_sums_the_time_inside_communication_phases():
    before = blocked_seconds("tensor-parallel")
    with phase("tensor-parallel all-gather (test)", comm=True):
        time.sleep(0.02)
    with phase("tensor-parallel compute (test)"):  # not communication: not counted
        time.sleep(0.02)
    assert 0.02 <= blocked_seconds("tensor-parallel") - before < 0.04
