"""Errors of checkpoint loading, apart from the loader so the tokenizer can raise them too."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint directory cannot be loaded; the message names the file and the tensor."""


class RankFailure(RuntimeError):
    """An expert-parallel peer rank died or stopped answering within the collective timeout.

    Not a per-request failure: every rank runs every forward, so the whole run ends
    (the scheduler's failure isolation lets it through).
    """
