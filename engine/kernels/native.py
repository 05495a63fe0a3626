"""Build a kernel source of this package once (g++, cached by content hash) and open it with ctypes.

A ctypes library, not a torch extension: it compiles in about a second against no torch
headers, and a call costs a few microseconds. Every failure is reported once, as one log
line, and returns None so that the caller falls back to its torch path.

Each source is written once against the vector layer ``vec.h`` and built per **variant**
(``VARIANTS``): 8 lanes for AVX2 + FMA, 16 for AVX-512, and the 16-lane code through SIMDe for
the tests of a CPU without AVX-512. The variant is chosen by the CPU's flags unless
``CHUNKSCOPE_KERNEL_ISA`` forces one; the build hash covers its flags, so each lives apart in the cache.
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
from dataclasses import dataclass
from pathlib import Path

from engine.model import cpu_features, reproducible

log = logging.getLogger("chunkscope.kernels")

SOURCE_DIR = Path(__file__).resolve().parent
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17")


@dataclass(frozen=True)
class Variant:
    """One build of the kernel sources: the vector width (vec.h), its compiler flags and the CPU flags it needs."""
    width: int
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    simde: bool = False  # the 16-lane code on AVX2 through SIMDe (tests only: never chosen by "auto")
    bf16_dot: bool = False  # bf16 GEMMs through AVX512-BF16's vdpbf16ps (else widened to float32 FMAs)


# avx512-simde is the avx512-bf16 source compiled against SIMDe's portable _mm512 (Debian's
# libsimde-dev): slower than any native build, it exists so that a CPU without AVX-512 runs
# the 16-lane code (and the bf16 dot product) in the equality tests.
VARIANTS = {
    "avx2": Variant(8, ("-mavx2", "-mfma"), ("avx2", "fma")),
    "avx512": Variant(16, ("-mavx512f", "-mavx2", "-mfma"), ("avx512f", "avx2", "fma")),
    "avx512-bf16": Variant(16, ("-mavx512f", "-mavx512bf16", "-mavx2", "-mfma"),
                           ("avx512f", "avx512_bf16", "avx2", "fma"), bf16_dot=True),
    # -O1 (the last -O wins): its speed does not matter, and -O3 took SIMDe's templates 61 s of CPU
    # for skinny_gemm.cpp (247 s wall at load 10, close to build_library's timeout), -O1 5 s.
    "avx512-simde": Variant(16, ("-O1", "-mavx2", "-mfma", "-Wno-psabi"), ("avx2", "fma"), simde=True,
                            bf16_dot=True),
}
# What "auto" takes: the first whose CPU flags this CPU has.
AUTO_ORDER = ("avx512-bf16", "avx512", "avx2")
SIMDE_HEADER = Path("simde/x86/avx512.h")
SIMDE_INCLUDE_DIRS = (Path("/usr/include"), Path("/usr/local/include"))

# Off with CHUNKSCOPE_NATIVE_KERNELS=0 (then every caller runs its torch path); tests and
# bench/forward.py --no-native flip the attribute.
ENABLED = os.environ.get("CHUNKSCOPE_NATIVE_KERNELS", "1") != "0"

# Which variant the kernels load: "auto" (avx512-bf16, avx512 or avx2: AUTO_ORDER) or a
# name of VARIANTS, forced (CHUNKSCOPE_KERNEL_ISA=avx2 on an AVX-512 machine measures the old
# kernels; tests and bench/forward.py --isa set the attribute). The C++ torch operators
# (torch_ops.py) take the variant in force when they are first built, once per process.
ISA = os.environ.get("CHUNKSCOPE_KERNEL_ISA", "auto")


def enabled() -> bool:
    """On unless turned off, and never inside the reproducible-numerics mode (its kernels are per-ISA builds)."""
    return ENABLED and not reproducible.active()


@functools.cache
def _cpu_flags() -> set[str]:
    return cpu_features.cpu_flags()


def variant_name(cpu_flags: set[str] | None = None, isa: str | None = None) -> str:
    """The variant in force: ``isa`` (default ISA) unless it is "auto", then by the CPU's flags."""
    isa = ISA if isa is None else isa
    if isa == "auto":
        flags_here = _cpu_flags() if cpu_flags is None else cpu_flags
        return next((name for name in AUTO_ORDER if set(VARIANTS[name].cpu_flags) <= flags_here), "avx2")
    if isa not in VARIANTS:
        raise ValueError(f"CHUNKSCOPE_KERNEL_ISA must be auto or one of {', '.join(VARIANTS)}, got {isa!r}")
    return isa


def flags(variant: str) -> list[str]:
    """The compiler flags of ``variant``'s build (the vector width is a define: vec.h)."""
    spec = VARIANTS[variant]
    defines = ([f"-DCHUNKSCOPE_VEC_WIDTH={spec.width}"] + (["-DCHUNKSCOPE_SIMDE"] if spec.simde else [])
               + (["-DCHUNKSCOPE_BF16_DOT"] if spec.bf16_dot else []))
    return [*BASE_FLAGS, *spec.flags, *defines]


def simde_available() -> bool:
    return any((root / SIMDE_HEADER).exists() for root in SIMDE_INCLUDE_DIRS)


def _build_dir() -> Path:
    root = os.environ.get("CHUNKSCOPE_CACHE") or Path.home() / ".cache" / "chunkscope"
    return Path(root).expanduser() / "kernels"


def why_unavailable(cpu_flags: set[str], compiler: str | None, variant: str | None = None,
                    simde: bool | None = None) -> str | None:
    """The reason ``variant`` (default: the one in force) cannot run here, or None (a pure check,
    tested without a compiler; ``simde`` says whether SIMDe's headers are installed)."""
    if not enabled():
        return "CHUNKSCOPE_NATIVE_KERNELS=0"
    variant = variant_name(cpu_flags) if variant is None else variant
    spec = VARIANTS[variant]
    missing = [flag for flag in spec.cpu_flags if flag not in cpu_flags]
    if missing:
        return f"the CPU lacks {' and '.join(missing)} (kernel variant {variant})"
    if compiler is None:
        return "no C++ compiler (g++ / c++) on PATH"
    if spec.simde and not (simde_available() if simde is None else simde):
        return "SIMDe's headers are not installed (apt-get install libsimde-dev)"
    return None


def variant_in_force() -> str | None:
    """``variant_name()``, or None (logged once) where CHUNKSCOPE_KERNEL_ISA names no variant: then the
    callers keep their torch paths, as for any other reason a kernel cannot run.

    Every kernel call asks (``bind``): the answer is kept per ISA setting and flag reader, since
    working it out again cost ~1 ms of a 25 ms smol decode step (600 calls of ~2 us)."""
    key = (ISA, _cpu_flags)  # a forced ISA (tests, bench/forward.py --isa) or a patched flag reader picks anew
    if key not in _IN_FORCE:
        try:
            _IN_FORCE[key] = variant_name()
        except ValueError as error:
            _warn_once(str(error))
            _IN_FORCE[key] = None
    return _IN_FORCE[key]


_IN_FORCE: dict[tuple, str | None] = {}


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("native kernels unavailable (%s): using the torch paths", message)


def load(name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """The compiled ``<name>.cpp`` of this package in ``variant`` (default: the one in force), or None
    (logged once) where it cannot be built."""
    variant = variant_in_force() if variant is None else variant
    return None if variant is None else _load(name, variant)


@functools.cache
def _load(name: str, variant: str) -> ctypes.CDLL | None:
    cxx = compiler()
    reason = why_unavailable(_cpu_flags(), cxx, variant)
    if reason is None:
        try:
            return ctypes.CDLL(str(_compiled(name, cxx, variant)))
        except (OSError, subprocess.SubprocessError) as error:
            reason = f"build failed: {str(error).strip()[:300]}"
    log.warning("native kernel %s (%s) unavailable (%s): using the torch path", name, variant, reason)
    return None


def bind(name: str, symbol: str, argtypes: tuple, restype=None):
    """``symbol`` of the compiled ``<name>.cpp`` (the variant in force) with its C signature set, or None
    where the library cannot be built (``load`` logs why, once). Built on the first call, then cached."""
    variant = variant_in_force()
    return None if variant is None else _bind(variant, name, symbol, argtypes, restype)


def clear_caches() -> None:
    """Forget every loaded library and bound symbol (tests that rebuild from other sources)."""
    _load.cache_clear()
    _bind.cache_clear()
    _IN_FORCE.clear()


@functools.cache
def _bind(variant: str, name: str, symbol: str, argtypes: tuple, restype):
    lib = _load(name, variant)
    if lib is None:
        return None
    function = getattr(lib, symbol)
    function.argtypes, function.restype = list(argtypes), restype
    return function


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++ or c++ on PATH, else None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path(name: str, compiler: str, source_dir: Path | None = None, variant: str = "avx2") -> Path:
    """Where ``name``'s build in ``variant`` lives in the cache: named by the hash of everything that makes it.

    The source, every header beside it (``vec.h`` is shared by all kernels, so a change to it must
    rebuild each one), the compiler and the flags (which hold the variant's width and ISA).
    """
    source_dir = SOURCE_DIR if source_dir is None else source_dir
    return hashed_path(f"{name}.{variant}", [source_dir / f"{name}.cpp"], compiler, flags(variant), source_dir)


def hashed_path(stem: str, sources: list[Path], compiler: str, flags: list[str], header_dir: Path,
                key: str = "") -> Path:
    """``<cache>/kernels/<stem>-<hash>.so``, the hash over the sources, every header in ``header_dir``,
    the compiler, the flags and ``key``."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in sources))
    for header in sorted(header_dir.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    digest.update(" ".join([compiler, *flags] + ([key] if key else [])).encode())
    return _build_dir() / f"{stem}-{digest.hexdigest()[:16]}.so"


def _compiled(name: str, compiler: str, variant: str = "avx2") -> Path:
    """The shared library for ``name`` in ``variant``, compiled unless the cache already holds this exact build."""
    return build_library(library_path(name, compiler, variant=variant), [SOURCE_DIR / f"{name}.cpp"], compiler,
                         flags(variant))


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
