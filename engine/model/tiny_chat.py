"""The embedded ``tiny-chat`` and ``tiny-chat-moe``: the tiny configurations trained on chat transcripts,
shipped in the repo.

Their files live in ``engine/model/tiny_chat/`` (with a seeded vision tower) and
``engine/model/tiny_chat_moe/`` (text only) and are loaded as they are (``./run.sh`` never trains);
``python -m engine.train [--family moe]`` reproduces them from the seed. ``manifest.json`` records
the training settings, the losses and each file's sha256; ``verify_manifest`` checks the files.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.model.errors import CheckpointError

TINY_CHAT_DIR = Path(__file__).with_name("tiny_chat")
TINY_CHAT_MOE_DIR = Path(__file__).with_name("tiny_chat_moe")
SHIPPED_DIRS = {"tiny-chat": TINY_CHAT_DIR, "tiny-chat-moe": TINY_CHAT_MOE_DIR}
MANIFEST = "manifest.json"
# Every shipped model has these; a vision checkpoint also preprocessor_config.json (hashed when present).
HASHED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "loss_curve.png")
OPTIONAL_HASHED_FILES = ("preprocessor_config.json",)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(directory: Path, record: dict) -> None:
    names = HASHED_FILES + tuple(n for n in OPTIONAL_HASHED_FILES if (directory / n).is_file())
    hashes = {name: sha256_of(directory / name) for name in names}
    (directory / MANIFEST).write_text(json.dumps({**record, "sha256": hashes}, indent=2) + "\n")


def read_manifest(directory: Path = TINY_CHAT_DIR) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def verify_manifest(directory: Path = TINY_CHAT_DIR) -> None:
    """Raise CheckpointError naming the first file missing or differing from its recorded sha256."""
    try:
        recorded = read_manifest(directory)["sha256"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{directory / MANIFEST}: unreadable manifest ({err})") from None
    for name in dict.fromkeys(HASHED_FILES + tuple(recorded)):   # the required files, then any other listed
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the manifest lists it)")
        if sha256_of(path) != recorded.get(name):
            raise CheckpointError(f"{path}: sha256 differs from {MANIFEST} (retrain with python -m engine.train)")


def tiny_chat_dir(name: str = "tiny-chat") -> Path:
    """The shipped checkpoint directory of ``name``, after checking its files against the manifest."""
    directory = SHIPPED_DIRS[name]
    verify_manifest(directory)
    return directory
