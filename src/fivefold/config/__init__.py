"""Run configuration: the schema (dataclasses in sections), the loader (TOML + overrides) and the reference.

    schema.py     one dataclass per section, each field documented; value and cross-section checks
    loader.py     defaults, TOML, `--section.key VALUE` overrides, renamed-key errors, did-you-mean
    reference.py  docs/configuration.md from the field docstrings
"""

from fivefold.config.loader import RENAMED, config_from_dict, config_toml, load_config, parse_overrides
from fivefold.config.reference import describe_config
from fivefold.config.schema import (
    SECTIONS,
    CheckpointConfig,
    ContextParallelConfig,
    DataConfig,
    DataParallelConfig,
    ExpertParallelConfig,
    GradientCommConfig,
    JobConfig,
    LoggingConfig,
    OptimConfig,
    ParameterServerConfig,
    PipelineParallelConfig,
    TensorParallelConfig,
    TrainConfig,
    check_choice,
)

__all__ = ["RENAMED", "SECTIONS", "CheckpointConfig", "ContextParallelConfig", "DataConfig", "DataParallelConfig", "ExpertParallelConfig",
           "GradientCommConfig", "JobConfig", "LoggingConfig", "OptimConfig", "ParameterServerConfig",
           "PipelineParallelConfig", "TensorParallelConfig", "TrainConfig", "check_choice", "config_from_dict", "config_toml",
           "describe_config", "load_config", "parse_overrides"]
