"""The model layer's errors, in a module of their own so the config readers (config.py,
gemma.py) can both raise them without importing each other."""
from __future__ import annotations


class UnsupportedModelError(ValueError):
    """A checkpoint asks for something this decoder cannot compute."""
