"""Image bytes by content hash: what a request's ``features.images`` names.

In memory, and written to a directory when given one (a run's ``images/``, one file per hash),
so a run's bundle carries its images and a replay finds them by the same hash. Torch-free: the
API frontend puts the images it received here before submitting.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.multimodal.limits import content_hash

IMAGES_DIR = "images"   # a run directory's images (and a bundle's members images/<hash>)


class ImageStore:
    def __init__(self, directory: Path | None = None):
        self.directory = Path(directory) if directory is not None else None
        self._bytes: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        """Keep ``data``; returns its content hash."""
        key = content_hash(data)
        if key not in self._bytes:
            self._bytes[key] = data
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
                path = self.directory / key
                if not path.exists():
                    tmp = path.with_suffix(".tmp")
                    tmp.write_bytes(data)
                    os.replace(tmp, path)
        return key

    def get(self, key: str) -> bytes:
        """The bytes of ``key``; KeyError naming it when neither memory nor the directory has them."""
        data = self._bytes.get(key)
        if data is None and self.directory is not None and (self.directory / key).is_file():
            data = self._bytes[key] = (self.directory / key).read_bytes()
        if data is None:
            raise KeyError(f"image {key[:12]}.. is not in the image store")
        return data

    def __contains__(self, key: str) -> bool:
        try:
            self.get(key)
            return True
        except KeyError:
            return False

    def hashes(self) -> list[str]:
        found = set(self._bytes)
        if self.directory is not None and self.directory.is_dir():
            found |= {p.name for p in self.directory.iterdir() if len(p.name) == 64}
        return sorted(found)
