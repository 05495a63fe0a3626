"""Errors of checkpoint loading, apart from the loader so the tokenizer can raise them too."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be loaded; the message names the file and the tensor."""
