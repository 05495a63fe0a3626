"""The native decode kernels as C++ torch operators (cpp_ops/torch_ops.cpp): ``torch.ops.chunkscope_native.*``.

Built once (g++ against torch's headers, ~15 s; cached by content hash beside the ctypes kernels,
``native.build_library``; in the kernel variant in force then, ``VARIANT``) and loaded with
``torch.ops.load_library``. A compiled decode step
calls them as graph nodes, so a call costs a dispatcher hop where the Python custom ops
(``custom_ops.py``) and the ctypes entry points cost 10-50 us of Python each. Built only where
a compiled step asks for it (``available()``), never by an eager forward, so a test or a server
without ``--compile`` never waits for the build. Every failure is logged once and leaves the
callers on their Python ops.
"""
from __future__ import annotations

import functools
import logging
import subprocess
from pathlib import Path

import torch

from engine.kernels import native

log = logging.getLogger("chunkscope.kernels")

NAMESPACE = "chunkscope_native"
# The operator definitions (in a folder of their own: the kernel sources beside native.py are each
# built alone), and the kernels compiled into the same library.
SOURCE = native.SOURCE_DIR / "cpp_ops" / "torch_ops.cpp"
KERNEL_SOURCES = ("skinny_gemm", "gdn_step", "paged_attention")
# The kernel variant (native.VARIANTS) the loaded operators were built in: the one in force at
# the first ``available()``, for the rest of the process (torch cannot unload a library).
VARIANT: str | None = None


def _flags(variant: str) -> list[str]:
    """``variant``'s kernel flags (native.flags: the vector width and ISA) with torch's headers and libraries."""
    root = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    kernel_flags = [flag for flag in native.flags(variant) if not flag.startswith("-std=")]
    return [*kernel_flags, "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.chunkscope_native`` is loaded (builds it on the first call; False, logged once)."""
    cxx, variant = native.compiler(), native.variant_in_force()
    reason = "no kernel variant" if variant is None else native.why_unavailable(native._cpu_flags(), cxx, variant)
    if reason is None:
        sources = [SOURCE] + [native.SOURCE_DIR / f"{name}.cpp" for name in KERNEL_SOURCES]
        try:
            # The torch version is in the key: the library links against this torch's ABI.
            flags = _flags(variant)
            target = native.hashed_path(f"torch_ops.{variant}", sources, cxx, flags, native.SOURCE_DIR,
                                        key=torch.__version__)
            library = native.build_library(target, sources, cxx, flags)
            global VARIANT
            VARIANT = variant
            torch.ops.load_library(str(library))
            _register_fakes()
            return True
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            reason = f"build or load failed: {str(error).strip()[:300]}"
    log.warning("native torch operators unavailable (%s): the compiled step calls the Python ops", reason)
    return False


def _register_fakes() -> None:
    """Output shapes for tracing (fake tensors carry no data): the same as the Python ops'."""
    @torch.library.register_fake(f"{NAMESPACE}::skinny_linear")
    def _skinny_linear_fake(x, packed, bias, out_cols):
        return x.new_empty(x.shape[0], out_cols)

    @torch.library.register_fake(f"{NAMESPACE}::swiglu_linear")
    def _swiglu_linear_fake(x, packed, intermediate):
        return x.new_empty(x.shape[0], intermediate)

    @torch.library.register_fake(f"{NAMESPACE}::gdn_decode_gated")
    def _gdn_fake(mixed, conv_pool, rec_pool, layer, conv_weight, slots, a, b, neg_rate, dt_bias, z, norm_weight,
                  eps, num_k_heads, key_dim, value_dim):
        return mixed.new_empty(mixed.shape[0], rec_pool.shape[2] * value_dim)

    @torch.library.register_fake(f"{NAMESPACE}::paged_decode_attention")
    def _attention_fake(q, new_keys, new_values, keys, values, kv_slots, block_tables, context_lens, gate):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
