"""User-facing exception families, all under one base.

Every failure fivefold raises on purpose is a `FivefoldError`: `ConfigError` for settings
(also a ValueError), `DataError` for corpora and tokenizers, `CheckpointError` for checkpoint
files, `ScheduleError` (parallel/pipeline/simulate.py) for instruction streams that cannot run.
Each message names the setting or file at fault and the fix; the CLI prints it without a traceback.
`TrainingFault` is a fault found while training (non-finite steps past the rollbacks allowed).

Exit codes of `fivefold` and of each rank: 0 done; 1 an unexpected error (a bug: rerun with
--debug for the traceback); 2 bad input (config, data, checkpoint); 3 a fault detected while
training (hung rank, stalled collective, non-finite training); 4 the launcher died.
"""

EXIT_INTERNAL = 1
EXIT_ERROR = 2
EXIT_FAULT = 3
EXIT_LAUNCHER_DIED = 4


class FivefoldError(Exception):
    """Base of every error fivefold raises on purpose."""

    exit_code = EXIT_ERROR


class ConfigError(FivefoldError, ValueError):
    """An invalid configuration: unknown key, bad value, inconsistent settings."""


class DataError(FivefoldError):
    """A corpus, tokenizer or token file that cannot be used as asked."""


class CheckpointError(FivefoldError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class TrainingFault(FivefoldError):
    """Training cannot go on: non-finite steps that rollbacks did not cure, or no checkpoint to roll back to."""

    exit_code = EXIT_FAULT
