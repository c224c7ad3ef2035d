"""Config: defaults < TOML < command line; every bad key or value fails before any work."""

import pytest

from fivefold.config import config_from_dict, load_config, parse_overrides
from fivefold.errors import ConfigError
from fivefold.parallel.mesh import dims_for
from fivefold.parallel.validate import check_config


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_then_overrides(tmp_path):
    path = write(tmp_path, '[model]\npreset = "small"\nn_layers = 3\n[train]\nsteps = 7\nseq_len = 64\n')
    cfg = load_config(path, ["--train.steps", "9", "--optim.lr=0.5", "--logging.progress", "false", "--model.rope-theta", "5e5"])
    assert cfg.model.name == "small" and cfg.model.dim == 768 and cfg.model.n_layers == 3
    assert cfg.train.steps == 9 and cfg.train.seq_len == 64
    assert cfg.optim.lr == 0.5 and cfg.logging.progress is False and cfg.model.rope_theta == 5e5


def test_preset_from_command_line():
    cfg = load_config(None, ["--model.preset", "llama3-8b", "--train.seq_len", "128"])
    assert cfg.model.vocab_size == 128256 and cfg.model.ffn_hidden_dim == 14336


@pytest.mark.parametrize(
    "args,message",
    [
        (["--train.stpes", "3"], r"unknown key train.stpes .*valid keys of \[train\]: steps, .*did you mean 'steps'"),
        (["--trian.steps", "3"], r"unknown config section \[trian\].*did you mean 'train'"),
        (["--train.steps", "many"], r"train.steps = 'many': expected int"),
        (["--train.steps", "0"], r"train.steps = 0: must be a positive integer"),
        (["--train.dtype", "bf61"], r"train.dtype = 'bf61' is not one of fp32, bf16 \(did you mean 'bf16'\?\)"),
        (["--optim.schedule", "cosin"], r"did you mean 'cosine'"),
        (["--model.preset", "llama3-9b"], r"model.preset = 'llama3-9b' is unknown.*did you mean 'llama3-8b'"),
        (["--model.n_heads", "5"], r"model.dim = 256 is not divisible by model.n_heads = 5"),
        (["--model.n_kv_heads", "3"], r"not a multiple of model.n_kv_heads = 3"),
        (["--train.seq_len", "4096"], r"train.seq_len = 4096 exceeds model.max_seq_len = 1024"),
        (["--logging.plot", "maybe"], r"logging.plot = 'maybe': expected bool"),
        (["--train.steps"], r"has no value"),
        (["--context_parallel.method", "rng"], r"context_parallel.method = 'rng' is not one of ring, ulysses, 2d"),
        (["--context_parallel.degree", "3"], r"context_parallel.degree = 3 \(ring\) cuts train.seq_len = 256 .*multiple of 2 x cp"),
        (["--context_parallel.degree", "4", "--context_parallel.method", "2d", "--context_parallel.heads", "3"],
         r"context_parallel.heads = 3 must divide context_parallel.degree = 4"),
        (["--context_parallel.degree", "16", "--context_parallel.method", "ulysses"], r"query heads per tensor-parallel rank"),
        (["steps=3"], r"overrides look like --section.key VALUE"),
        (["--gradient_comm.allreduce_algorithm", "rign"], r"gradient_comm.allreduce_algorithm = 'rign' is not one of native, ring.*did you mean 'ring'"),
        (["--gradient_comm.compression", "int4"], r"gradient_comm.compression = 'int4' is not one of none, int8"),
        (["--gradient_comm.compression", "int8", "--data_parallel.zero_stage", "1", "--data_parallel.shard", "2"],
         r"drive DDP's gradient buckets.*set zero_stage = 0"),
        (["--gradient_comm.compression_block", "100"], r"gradient_comm.compression_block = 100: must be a positive multiple of 8"),
        (["--gradient_comm.topk_ratio", "0"], r"gradient_comm.topk_ratio = 0.0: must be in \(0, 1\]"),
        (["--gradient_comm.schedule", "priority"], r"clipping by the global norm \(train.max_grad_norm = 1.0\).*set train.max_grad_norm = 0"),
        (["--gradient_comm.schedule", "priority", "--gradient_comm.compression", "sign", "--train.max_grad_norm", "0"],
         r"gradient_comm.schedule = priority re-orders DDP's dense bucket all-reduces"),
        (["--data_parallel.mode", "ps", "--tensor_parallel.degree", "2"], r"data_parallel.mode = ps keeps whole models on the workers: set tensor_parallel.degree"),
        (["--data_parallel.mode", "ps", "--parameter_server.sync", "bssp"], r"parameter_server.sync = 'bssp' is not one of bsp, asp, ssp"),
        # keys of the flat [parallel] section of earlier versions name their new place
        (["--parallel.tp", "2"], r"parallel.tp in command-line overrides was renamed: use tensor_parallel.degree"),
        (["--parallel.comm_schedule", "priority"], r"was renamed: use gradient_comm.schedule"),
        (["--parallel.nonsense", "1"], r"the \[parallel\] settings now live in .*\[tensor_parallel\]"),
        # a key in the wrong section suggests the section that has it
        (["--train.lr", "0.1"], r"unknown key train.lr .*did you mean 'optim.lr'\?"),
        (["--optim.steps", "3"], r"did you mean 'train.steps'\?"),
        # a setting the mode would ignore is an error, never silence
        (["--gradient_comm.bucket_mb", "5", "--data_parallel.zero_stage", "2", "--data_parallel.shard", "2"],
         r"gradient_comm.bucket_mb drive DDP's gradient buckets"),
        (["--data_parallel.mode", "ps", "--gradient_comm.reduce_dtype", "bf16"], r"gradient_comm.reduce_dtype shape DDP's"),
        (["--parameter_server.servers", "2"], r"parameter_server.servers only apply with data_parallel.mode = ps"),
        (["--gradient_comm.slice_mb", "0.5"], r"slice_mb sizes the priority schedule's slices"),
        (["--gradient_comm.bucket_mb", "nan"], r"gradient_comm.bucket_mb = nan: must be a finite number"),
        (["--train.recompute", "some"], r"train.recompute = 'some' is not one of none, full, selective"),
        (["--parameter_server.staleness", "-1"], r"parameter_server.staleness = -1: must be >= 0"),
        (["--pipeline_parallel.scatter_gather", "true"], r"scatter_gather splits the messages between pipeline stages: "
                                                          r"set pipeline_parallel.degree > 1"),
        (["--pipeline_parallel.degree", "2", "--pipeline_parallel.scatter_gather", "true"],
         r"whole on every rank of a tensor-parallel group of 1: set tensor_parallel.degree > 1"),
        (["--pipeline_parallel.degree", "2", "--pipeline_parallel.scatter_gather", "true", "--tensor_parallel.degree",
          "2", "--tensor_parallel.sequence_parallel", "true"], r"sequence_parallel already sends each rank's own sequence"),
        (["--pipeline_parallel.degree", "2", "--pipeline_parallel.placement", "middle"],
         r"pipeline_parallel.placement = 'middle' is not one of outer, inner"),
        (["--pipeline_parallel.placement", "inner"], r"placement = 'inner' places pipeline stages: set pipeline_parallel.degree > 1"),
    ],
)
def test_bad_input_names_the_setting(args, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, args))


def test_configs_saved_with_the_flat_parallel_section_still_load():
    """Checkpoints written before the split keep working: their [parallel] keys are translated."""
    saved = {"parallel": {"tp": 2, "sequence_parallel": True, "comm_schedule": "fifo", "recompute": "full", "dp_shard": 1}}
    config = config_from_dict(saved)
    assert config.tensor_parallel.degree == 2 and config.tensor_parallel.sequence_parallel
    assert config.train.recompute == "full" and config.gradient_comm.schedule == "fifo"


def test_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\nsteps = 1"))
    with pytest.raises(ConfigError, match=r"unknown key data.tokeniser .*did you mean 'tokenizer'"):
        load_config(write(tmp_path, '[data]\ntokeniser = "bpe"\n'))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_round_trip_through_dict():
    cfg = load_config(None, ["--model.preset", "small", "--train.steps", "3"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_parse_overrides_dashes():
    assert parse_overrides(["--train.micro-batch-size", "2"]) == {"train": {"micro_batch_size": "2"}}


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        load_config(path)


def test_configuration_reference_is_current():
    """docs/configuration.md is the output of `fivefold config --reference`; regenerate it when fields change."""
    from pathlib import Path

    from fivefold.config import describe_config

    doc = Path(__file__).parent.parent / "docs" / "configuration.md"
    assert doc.read_text() == describe_config(), "run: fivefold config --reference > docs/configuration.md"
    assert "| steps | int | 200 | Optimizer steps to run. |" in describe_config()


def test_parameter_servers_leave_workers():
    config = load_config(None, ["--data_parallel.mode", "ps", "--parameter_server.servers", "2"])
    assert dims_for(config, 5).dp == 3
    with pytest.raises(ConfigError, match="parameter_server.servers = 2 leaves no worker among 2 ranks"):
        dims_for(config, 2)
