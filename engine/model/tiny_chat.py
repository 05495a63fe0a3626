"""The embedded ``tiny-chat``: the tiny configuration trained on chat transcripts, shipped in the repo.

Its files live in ``engine/model/tiny_chat/`` and are loaded as they are (``./run.sh`` never
trains); ``python -m engine.train`` reproduces them from the seed. ``manifest.json`` records the
training settings, the losses and each file's sha256; ``verify_manifest`` checks the files.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.model.errors import CheckpointError

TINY_CHAT_DIR = Path(__file__).with_name("tiny_chat")
MANIFEST = "manifest.json"
HASHED_FILES = ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
                "chat_template.jinja", "loss_curve.png")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(directory: Path, record: dict) -> None:
    hashes = {name: sha256_of(directory / name) for name in HASHED_FILES}
    (directory / MANIFEST).write_text(json.dumps({**record, "sha256": hashes}, indent=2) + "\n")


def read_manifest(directory: Path = TINY_CHAT_DIR) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def verify_manifest(directory: Path = TINY_CHAT_DIR) -> None:
    """Raise CheckpointError naming the first file missing or differing from its recorded sha256."""
    try:
        recorded = read_manifest(directory)["sha256"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{directory / MANIFEST}: unreadable manifest ({err})") from None
    for name in HASHED_FILES:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the manifest lists it)")
        if sha256_of(path) != recorded.get(name):
            raise CheckpointError(f"{path}: sha256 differs from {MANIFEST} (retrain with python -m engine.train)")


def tiny_chat_dir() -> Path:
    """The shipped checkpoint directory, after checking its files against the manifest."""
    verify_manifest()
    return TINY_CHAT_DIR
