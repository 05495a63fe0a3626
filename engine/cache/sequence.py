"""Per-sequence cache state shared by the caches, the model runner and the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SequenceState:
    """Where one sequence's state lives in the paged KV cache and the SSM pool.

    ``num_cached_tokens`` counts the tokens whose K/V (and SSM effect) are
    already in the caches; the next forward for this sequence starts there.
    """

    request_id: int
    block_table: list[int] = field(default_factory=list)
    ssm_slot: int | None = None
    num_cached_tokens: int = 0
    # The main model's hidden state at the last cached position, waiting for the next token so
    # the MTP layer can run that row (engine/model/mtp_feed.py); None without MTP history.
    mtp_hidden: Any = None
    # The prompt's images (engine/multimodal/prompt_images.PromptImages): M-RoPE positions and
    # placeholder spans; None for a text-only prompt.
    images: Any = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)
