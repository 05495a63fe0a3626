"""Which speculation kinds the loaded model can run; the others are refused when the lever is set.

``ngram`` drafts from the token history and needs nothing from the model.
``mtp`` drafts with the checkpoint's multi-token-prediction module and ``self``
with an early exit of the model itself; a model exposes them with
``has_mtp_head`` / ``has_self_draft``. A checkpoint without ``mtp.*`` tensors
has no head: asking for ``mtp`` would only change the can-mix verdict without
any draft, so the lever change is rejected instead, with the reason logged
(``mtp_absent_reason``), and the previous value stays.
"""
from __future__ import annotations

from typing import Any

from engine.spec.kinds import SPEC_MTP, SPEC_SELF, is_speculative


def speculation_rejection(speculation: str, model: Any) -> str | None:
    """Why ``model`` cannot run ``speculation`` (a one-line reason), or None when it can."""
    is_speculative(speculation)  # an unknown kind raises ValueError naming the lever
    if speculation == SPEC_MTP and not getattr(model, "has_mtp_head", False):
        why = getattr(model, "mtp_absent_reason", "no MTP module attached")
        return f"speculation=mtp needs a multi-token-prediction head; the loaded model has none ({why})"
    if speculation == SPEC_SELF and not getattr(model, "has_self_draft", False):
        return ("speculation=self needs a self-speculative draft path (layer-skip drafting); "
                "the loaded model has none")
    return None
