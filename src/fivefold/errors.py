"""User-facing exception families.

One type per family of failure, each message naming the setting at fault and the fix.
"""


class FivefoldError(Exception):
    """Base of every error fivefold raises on purpose."""


class ConfigError(FivefoldError, ValueError):
    """An invalid configuration: unknown key, bad value, inconsistent settings."""


class DataError(FivefoldError):
    """A corpus, tokenizer or token file that cannot be used as asked."""


class CheckpointError(FivefoldError):
    """A checkpoint that is missing, incomplete or does not match the run."""
