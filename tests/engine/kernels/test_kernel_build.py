"""How the native kernels are built: one shared header for the vector helpers, and a cache key that covers it."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from engine.kernels import native

KERNELS = sorted(path.stem for path in native.SOURCE_DIR.glob("*.cpp"))
# What avx2_math.h defines: a kernel source must include it, never define its own copy.
HELPER_DEFINITION = re.compile(r"inline\s+(?:float|__m256)\s+(hsum8?|exp\w*|silu\w*|sigmoid\w*)\s*\(")


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A copy of the kernel sources, with the build cache beside it."""
    copy = tmp_path / "kernels"
    shutil.copytree(native.SOURCE_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setenv("CHUNKSCOPE_CACHE", str(tmp_path / "cache"))
    return copy


def test_every_kernel_takes_the_vector_helpers_from_the_shared_header():
    assert KERNELS == ["gdn_step", "paged_attention", "rms_norm", "skinny_gemm"]
    for name in KERNELS:
        text = (native.SOURCE_DIR / f"{name}.cpp").read_text()
        assert HELPER_DEFINITION.findall(text) == [], f"{name}.cpp defines its own copy of a shared helper"
        used = re.findall(r"avx2::\w+", text)
        assert not used or '#include "avx2_math.h"' in text, name
    assert set(HELPER_DEFINITION.findall((native.SOURCE_DIR / "avx2_math.h").read_text())) >= {
        "hsum", "hsum8", "exp", "silu", "sigmoid"}


def test_a_header_change_moves_every_kernel_to_a_new_build(sources):
    before = {name: native.library_path(name, "g++", sources) for name in KERNELS}
    assert len(set(before.values())) == len(KERNELS)
    assert before == {name: native.library_path(name, "g++", sources) for name in KERNELS}  # stable

    header = sources / "avx2_math.h"
    header.write_text(header.read_text() + "\n// a comment changes the build too\n")
    after_header = {name: native.library_path(name, "g++", sources) for name in KERNELS}
    assert all(after_header[name] != before[name] for name in KERNELS)

    source = sources / "rms_norm.cpp"
    source.write_text(source.read_text() + "\n")
    after_source = {name: native.library_path(name, "g++", sources) for name in KERNELS}
    assert [name for name in KERNELS if after_source[name] != after_header[name]] == ["rms_norm"]
    assert native.library_path("rms_norm", "clang++", sources) != after_source["rms_norm"]


@pytest.mark.skipif(native.why_unavailable(native._cpu_flags(), shutil.which("g++")) is not None,
                    reason="no AVX2/FMA CPU or no g++ here")
def test_the_build_rebuilds_after_a_header_edit(sources, monkeypatch):
    """Through ``load``: the edited header is compiled in (a broken header fails the build)."""
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    native.load.cache_clear()
    try:
        assert native.load("rms_norm") is not None
        header = sources / "avx2_math.h"
        header.write_text(header.read_text().replace("namespace avx2 {", "namespace avx2 { this does not compile"))
        native.load.cache_clear()
        with pytest.raises(subprocess.SubprocessError, match="error"):
            native._compiled("rms_norm", shutil.which("g++"))
        assert len(list((sources.parent / "cache" / "kernels").glob("rms_norm-*.so"))) == 1
    finally:
        native.load.cache_clear()
