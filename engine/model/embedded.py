"""Model names that need no download: seeded checkpoints built into a cache directory on first use,
and ``tiny-chat`` / ``tiny-chat-moe``, trained here and shipped in the repository (``engine/model/tiny_chat/``,
``engine/model/tiny_chat_moe/``)."""
from __future__ import annotations

from pathlib import Path

EMBEDDED_MODELS = ("tiny", "tiny-moe", "tiny-kimi", "tiny-vl", "tiny-chat", "tiny-chat-moe")


def checkpoint_dir_of(name_or_dir: str) -> Path:
    """The checkpoint directory for an embedded model (created on first use; ``tiny-chat`` and
    ``tiny-chat-moe`` are shipped, their files checked against their manifests) or a path."""
    if name_or_dir == "tiny":
        from engine.model.tiny import ensure_tiny_checkpoint
        return ensure_tiny_checkpoint()
    if name_or_dir == "tiny-moe":
        from engine.model.tiny_moe import ensure_tiny_moe_checkpoint
        return ensure_tiny_moe_checkpoint()
    if name_or_dir == "tiny-kimi":
        from engine.model.tiny_kimi import ensure_tiny_kimi_checkpoint
        return ensure_tiny_kimi_checkpoint()
    if name_or_dir == "tiny-vl":
        from engine.model.tiny_vl import ensure_tiny_vl_checkpoint
        return ensure_tiny_vl_checkpoint()
    if name_or_dir in ("tiny-chat", "tiny-chat-moe"):
        from engine.model.tiny_chat import tiny_chat_dir
        return tiny_chat_dir(name_or_dir)
    return Path(name_or_dir).expanduser()
