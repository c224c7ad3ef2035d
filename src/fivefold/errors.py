"""User-facing exception families, all under one base.

Every failure fivefold raises on purpose is a `FivefoldError`: `ConfigError` for settings
(also a ValueError), `DataError` for corpora and tokenizers, `CheckpointError` for checkpoint
files, `ScheduleError` (parallel/pipeline/simulate.py) for instruction streams that cannot run.
Each message names the setting or file at fault and the fix; the CLI prints it without a traceback.
"""


class FivefoldError(Exception):
    """Base of every error fivefold raises on purpose."""


class ConfigError(FivefoldError, ValueError):
    """An invalid configuration: unknown key, bad value, inconsistent settings."""


class DataError(FivefoldError):
    """A corpus, tokenizer or token file that cannot be used as asked."""


class CheckpointError(FivefoldError):
    """A checkpoint that is missing, incomplete or does not match the run."""
