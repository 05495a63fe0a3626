"""How the native kernels are built: one vector layer (vec.h) for every width, and a cache key that covers it and the variant."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from engine.kernels import native, skinny_gemm

KERNELS = sorted(path.stem for path in native.SOURCE_DIR.glob("*.cpp"))
# What vec.h defines: a kernel source must include it, never define its own copy.
HELPER_DEFINITION = re.compile(r"inline\s+(?:float|V|void)\s+(hsum\w*|exp\w*|silu\w*|sigmoid\w*)\s*\(")
# Width-specific code (intrinsics, vector types, literal widths in loop steps) belongs in vec.h only.
WIDTH_SPECIFIC = re.compile(r"_mm256_|_mm512_|__m256|__m512|simde_|avx2::|immintrin")


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A copy of the kernel sources, with the build cache beside it."""
    copy = tmp_path / "kernels"
    shutil.copytree(native.SOURCE_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setenv("CHUNKSCOPE_CACHE", str(tmp_path / "cache"))
    return copy


def test_every_kernel_is_written_once_against_the_vector_layer():
    """One source per kernel for every width: the intrinsics of either ISA appear in vec.h only."""
    assert KERNELS == ["gdn_step", "paged_attention", "rms_norm", "skinny_gemm"]
    for name in KERNELS:
        text = (native.SOURCE_DIR / f"{name}.cpp").read_text()
        assert HELPER_DEFINITION.findall(text) == [], f"{name}.cpp defines its own copy of a shared helper"
        assert '#include "vec.h"' in text, name
        assert WIDTH_SPECIFIC.findall(text) == [], f"{name}.cpp has width-specific code outside vec.h"
    assert set(HELPER_DEFINITION.findall((native.SOURCE_DIR / "vec.h").read_text())) >= {
        "hsum", "hsum8_scaled", "exp", "silu", "sigmoid"}


def test_each_variant_is_a_build_of_its_own():
    paths = {variant: native.library_path("skinny_gemm", "g++", variant=variant) for variant in native.VARIANTS}
    assert len(set(paths.values())) == len(native.VARIANTS)
    assert all(f"skinny_gemm.{variant}-" in path.name for variant, path in paths.items())
    assert "-DCHUNKSCOPE_VEC_WIDTH=16" in native.flags("avx512") and "-mavx512f" in native.flags("avx512")
    assert "-DCHUNKSCOPE_SIMDE" in native.flags("avx512-simde") and "-mavx512f" not in native.flags("avx512-simde")
    assert "-DCHUNKSCOPE_BF16_DOT" in native.flags("avx512-bf16") and "-mavx512bf16" in native.flags("avx512-bf16")
    assert "-DCHUNKSCOPE_BF16_DOT" not in native.flags("avx512")


def test_the_variant_follows_the_cpu_unless_forced(monkeypatch):
    xeon, icelake = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, {"avx2", "fma", "avx512f"}
    epyc = {"avx2", "fma"}
    assert native.variant_name(xeon, "auto") == "avx512-bf16" and native.variant_name(icelake, "auto") == "avx512"
    assert native.variant_name(epyc, "auto") == "avx2"
    assert native.variant_name(xeon, "avx2") == "avx2"  # the forced AVX2 row of an AVX-512 machine
    assert native.variant_name(epyc, "avx512-simde") == "avx512-simde"  # never chosen by auto
    with pytest.raises(ValueError, match="CHUNKSCOPE_KERNEL_ISA"):
        native.variant_name(epyc, "avx1024")
    assert "avx512f" in native.why_unavailable(epyc, "g++", "avx512")
    assert "avx512_bf16" in native.why_unavailable(icelake, "g++", "avx512-bf16")
    assert native.why_unavailable(xeon, "g++", "avx512") is None
    assert "libsimde-dev" in native.why_unavailable(epyc, "g++", "avx512-simde", simde=False)
    monkeypatch.setattr(native, "ISA", "avx2")
    assert native.variant_name(xeon) == "avx2"


def test_a_bad_variant_name_leaves_the_torch_paths_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(native, "ISA", "avx1024")
    native._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="chunkscope.kernels"):
        assert native.load("rms_norm") is None and not skinny_gemm.available()
        assert skinny_gemm.pack(torch.randn(4, 4)) is None
    assert [r.getMessage() for r in caplog.records].count(
        "native kernels unavailable (CHUNKSCOPE_KERNEL_ISA must be auto or one of avx2, avx512, avx512-bf16, "
        "avx512-simde, got 'avx1024'): using the torch paths") == 1


def test_a_header_change_moves_every_kernel_to_a_new_build(sources):
    before = {name: native.library_path(name, "g++", sources) for name in KERNELS}
    assert len(set(before.values())) == len(KERNELS)
    assert before == {name: native.library_path(name, "g++", sources) for name in KERNELS}  # stable

    header = sources / "vec.h"
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
    native.clear_caches()
    try:
        assert native.load("rms_norm") is not None
        header = sources / "vec.h"
        header.write_text(header.read_text().replace("namespace vec {", "namespace vec { this does not compile"))
        native.clear_caches()
        with pytest.raises(subprocess.SubprocessError, match="error"):
            native._compiled("rms_norm", shutil.which("g++"), native.variant_name())
        assert len(list((sources.parent / "cache" / "kernels").glob("rms_norm.*.so"))) == 1
    finally:
        native.clear_caches()
