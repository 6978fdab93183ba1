"""The one error type users see when a checkpoint cannot be loaded."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, malformed or does not match its config.

    The message is one plain line, fit to print without a traceback.
    """
