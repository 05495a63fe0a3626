"""Build a kernel source of this package once (g++, cached by content hash) and open it with ctypes.

A ctypes library, not a torch extension: it compiles in about a second against no torch
headers, and a call costs a few microseconds. Every failure is reported once, as one log
line, and returns None so that the caller falls back to its torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("chunkscope.kernels")

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx2", "fma")


# Off with CHUNKSCOPE_NATIVE_KERNELS=0 (then every caller runs its torch path); tests and
# bench/forward.py --no-native flip the attribute.
ENABLED = os.environ.get("CHUNKSCOPE_NATIVE_KERNELS", "1") != "0"


def enabled() -> bool:
    return ENABLED


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            line = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def _build_dir() -> Path:
    root = os.environ.get("CHUNKSCOPE_CACHE") or Path.home() / ".cache" / "chunkscope"
    return Path(root).expanduser() / "kernels"


def why_unavailable(cpu_flags: set[str], compiler: str | None) -> str | None:
    """The reason no native kernel can run here, or None (a pure check, tested without a compiler)."""
    if not enabled():
        return "CHUNKSCOPE_NATIVE_KERNELS=0"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags]
    if missing:
        return f"the CPU lacks {' and '.join(missing)}"
    if compiler is None:
        return "no C++ compiler (g++ / c++) on PATH"
    return None


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled ``<name>.cpp`` of this package, or None (logged once) where it cannot be built."""
    cxx = compiler()
    reason = why_unavailable(_cpu_flags(), cxx)
    if reason is None:
        try:
            return ctypes.CDLL(str(_compiled(name, cxx)))
        except (OSError, subprocess.SubprocessError) as error:
            reason = f"build failed: {str(error).strip()[:300]}"
    log.warning("native kernel %s unavailable (%s): using the torch path", name, reason)
    return None


@functools.cache
def bind(name: str, symbol: str, argtypes: tuple, restype=None):
    """``symbol`` of the compiled ``<name>.cpp`` with its C signature set, or None where the library
    cannot be built (``load`` logs why, once). Built on the first call, then cached."""
    lib = load(name)
    if lib is None:
        return None
    function = getattr(lib, symbol)
    function.argtypes, function.restype = list(argtypes), restype
    return function


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++ or c++ on PATH, else None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(name: str, compiler: str, source_dir: Path | None = None) -> Path:
    """Where ``name``'s build lives in the cache: named by the hash of everything that makes it.

    The source, every header beside it (``avx2_math.h`` is shared by all kernels, so a change to
    it must rebuild each one), the compiler and the flags.
    """
    source_dir = SOURCE_DIR if source_dir is None else source_dir
    return hashed_path(name, [source_dir / f"{name}.cpp"], compiler, FLAGS, source_dir)


def hashed_path(stem: str, sources: list[Path], compiler: str, flags: list[str], header_dir: Path,
                key: str = "") -> Path:
    """``<cache>/kernels/<stem>-<hash>.so``, the hash over the sources, every header in ``header_dir``,
    the compiler, the flags and ``key``."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in sources))
    for header in sorted(header_dir.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    digest.update(" ".join([compiler, *flags] + ([key] if key else [])).encode())
    return _build_dir() / f"{stem}-{digest.hexdigest()[:16]}.so"


def _compiled(name: str, compiler: str) -> Path:
    """The shared library for ``name``, compiled unless the cache already holds this exact build."""
    return build_library(library_path(name, compiler), [SOURCE_DIR / f"{name}.cpp"], compiler, FLAGS)


def build_library(target: Path, sources: list[Path], compiler: str, flags: list[str]) -> Path:
    """``sources`` compiled and linked with ``flags`` into ``target``, unless it exists already."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never opens a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        # Sources before the flags: libraries named by -l must follow the objects that use them.
        command = [compiler, *[str(source) for source in sources], *flags, "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise subprocess.SubprocessError(result.stderr or f"{compiler} exited {result.returncode}")
        os.replace(built, target)
    log.info("native kernel %s built: %s", target.stem.rsplit("-", 1)[0], target)
    return target
