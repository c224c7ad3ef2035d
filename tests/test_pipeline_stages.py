"""The stage split: balanced by cost (embedding and head included), explicit override, clear errors."""

import pytest
import torch

from conftest import micro_model
from fivefold.config import load_config
from fivefold.errors import ConfigError
from fivefold.model import build_model
from fivefold.model.presets import get_preset
from fivefold.parallel.pipeline.stages import (
    StageCosts,
    cut_model,
    explicit_split,
    holds_tied_copy,
    plan_stages,
    split_layers,
    stage_costs,
    stages_of_rank,
)


def test_uniform_blocks_split_evenly():
    assert split_layers(StageCosts(0.0, (1.0,) * 8, 0.0), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_an_expensive_head_takes_blocks_off_the_last_stage():
    # the head costs 2 blocks: 5 blocks vs 3 blocks + head is the most even split
    costs = StageCosts(0.0, (1.0,) * 8, 2.0)
    split = split_layers(costs, 2)
    assert split == [[0, 1, 2, 3, 4], [5, 6, 7]]


def test_the_split_minimises_the_largest_stage_exhaustively():
    import itertools

    costs = StageCosts(1.5, (1.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0), 2.5)
    n, stages = len(costs.blocks), 3
    split = split_layers(costs, stages)
    assert sorted(layer for stage in split for layer in stage) == list(range(n))

    def largest(bounds):
        edges = [0, *bounds, n]
        loads = [sum(costs.blocks[a:b]) for a, b in zip(edges, edges[1:])]
        loads[0] += costs.embedding
        loads[-1] += costs.head
        return max(loads)

    best = min(largest(c) for c in itertools.combinations(range(1, n), stages - 1))
    ours = largest([len(split[0]), len(split[0]) + len(split[1])])
    assert ours == best


def test_flops_and_params_costs_count_embedding_and_head():
    config = get_preset("llama3-8b")
    flops = stage_costs(config, 8192, "flops")
    params = stage_costs(config, 8192, "params")
    assert flops.embedding == 0 and flops.head == 6 * config.vocab_size * config.dim
    assert params.embedding == config.vocab_size * config.dim
    # Llama-3 8B: the 128k-vocab head costs about as much as 2 blocks of training FLOPs
    assert 1.0 < flops.head / flops.blocks[0] < 3.0
    split = plan_stages(config, 8192, 4)
    sizes = [len(s) for s in split]
    assert sizes[-1] == 7 and sorted(sizes) == [7, 8, 8, 9]  # the head's stage gives up blocks


def test_explicit_split_and_its_errors():
    assert explicit_split([0, 3, 3, 2], 8, 4) == [[], [0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="4 stages"):
        explicit_split([4, 4], 8, 4)
    with pytest.raises(ConfigError, match="add up"):
        explicit_split([2, 2, 2, 1], 8, 4)
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1\]"):
        explicit_split([4, 0, 2, 2], 8, 4)


def test_too_many_stages_is_an_error_naming_the_settings():
    with pytest.raises(ConfigError, match="pipeline_parallel.degree x pipeline_parallel.virtual.*model.n_layers = 2"):
        plan_stages(micro_model(), 32, 4)


def test_cutting_keeps_only_the_ranks_blocks_and_names():
    config = micro_model(n_layers=4, vocab_size=64)
    split = [[0], [1], [2], [3]]
    first, middle, last = (build_model(config) for _ in range(3))
    cut_model(first, stages_of_rank(split, 2, 0))  # stages 0 and 2
    cut_model(last, stages_of_rank(split, 2, 1))  # stages 1 and 3
    assert list(first.layers) == ["0", "2"] and first.tok_embeddings is not None and first.norm is None
    assert list(last.layers) == ["1", "3"] and last.tok_embeddings is None and last.output is not None
    tied = build_model(micro_model(n_layers=4, vocab_size=64, tie_embeddings=True))
    stages = stages_of_rank(split, 4, 3)
    cut_model(tied, stages)
    assert tied.tok_embeddings is not None and holds_tied_copy(tied, stages)
    cut_model(middle, stages_of_rank(split, 4, 1))
    assert {n for n, _ in middle.named_parameters()} == {n for n, _ in build_model(config).named_parameters()
                                                         if n.startswith("layers.1.")}


def test_stages_run_the_same_function_as_the_model():
    torch.manual_seed(0)
    from fivefold.model import materialize

    config = micro_model(n_layers=4, vocab_size=64)
    model = materialize(build_model(config), seed=3)
    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16)
    h = tokens
    for stage in stages_of_rank([[0], [1, 2], [3]], 1, 0):
        h = stage.forward(model, h, positions)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


def test_pipeline_settings_are_checked_before_any_work(tmp_path):
    from fivefold.parallel.validate import check_config

    def load(*overrides):
        return check_config(load_config(None, ["--model.n_layers", "4", *overrides]))

    with pytest.raises(ConfigError, match="pipeline_parallel.virtual >= 2"):
        load("--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "interleaved")
    with pytest.raises(ConfigError, match="multiple of pp"):
        load("--pipeline_parallel.degree", "2", "--pipeline_parallel.schedule", "interleaved", "--pipeline_parallel.virtual", "2",
             "--train.grad_accum_steps", "3")
    with pytest.raises(ConfigError, match="ZeRO-2/3"):
        load("--pipeline_parallel.degree", "2", "--data_parallel.zero_stage", "2", "--data_parallel.shard", "2")
    with pytest.raises(ConfigError, match="set pipeline_parallel.degree > 1"):
        load("--pipeline_parallel.virtual", "2")
    with pytest.raises(ConfigError, match="model.n_layers = 4"):
        load("--pipeline_parallel.degree", "8")
    with pytest.raises(ConfigError, match="expected int"):
        load("--pipeline_parallel.degree", "2", "--pipeline_parallel.layers_per_stage", "2,x")
    assert load("--pipeline_parallel.degree", "2", "--pipeline_parallel.layers_per_stage", "1,3").pipeline_parallel.layers_per_stage == [1, 3]


def test_the_run_config_drives_the_split():
    """pipeline_parallel.layers_per_stage and pipeline_parallel.balance reach the split the trainer uses (check_pipeline)."""
    from fivefold.parallel.pipeline.stages import check_pipeline

    def split(*overrides):
        config = load_config(None, ["--model.n_layers", "4", "--model.vocab_size", "4096", "--pipeline_parallel.degree", "2",
                                    *overrides])
        return check_pipeline(config.model, config.pipeline_parallel, config.train.seq_len, config.train.grad_accum_steps)

    assert split("--pipeline_parallel.layers_per_stage", "1,3") == [[0], [1, 2, 3]]
    # a 4096-token vocabulary: by parameters embedding and head weigh the same, by FLOPs only the head counts
    assert split("--pipeline_parallel.balance", "params") != split("--pipeline_parallel.balance", "flops")
