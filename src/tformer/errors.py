"""Errors a user can act on. The CLI prints them as one line `error: ...` and exits with code 2.
A warning (`warn`) is one line `warning: ...` on stderr, and the work goes on."""

import sys


class TformerError(Exception):
    """An error caused by the user's input (a file, a flag, a checkpoint), with a message that says
    what went wrong and how to fix it."""


class ConfigError(TformerError, ValueError):
    """An invalid model configuration or argument value."""


class CheckpointError(TformerError):
    """A checkpoint directory that cannot be read: missing file, corrupt JSON, missing/unexpected key."""


class DataError(TformerError):
    """Input data that cannot be used: missing, empty, undecodable, wrong columns."""


def warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")
