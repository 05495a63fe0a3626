"""The speculation kinds (the ``speculation`` lever's values) and the one check every user makes."""
from __future__ import annotations

SPEC_OFF = "off"
SPEC_MTP = "mtp"          # multi-token-prediction head drafts
SPEC_SELF = "self"        # self-speculative (layer-skip) drafts
SPEC_NGRAM = "ngram"      # prompt-lookup n-gram drafts
SPECULATION_KINDS = (SPEC_OFF, SPEC_MTP, SPEC_SELF, SPEC_NGRAM)


def is_speculative(speculation: str) -> bool:
    """True for any speculation kind but "off"; an unknown kind is a ValueError naming the lever."""
    if speculation not in SPECULATION_KINDS:
        raise ValueError(f"speculation must be one of {SPECULATION_KINDS}, got {speculation!r}")
    return speculation != SPEC_OFF
