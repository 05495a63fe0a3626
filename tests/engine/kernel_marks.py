"""What the native-kernel tests share: a skip where a kernel cannot be built here, and one torch thread.

The kernels run single-threaded inside the engine (``serve`` sets one torch thread), and the
library paths they are compared with pick other algorithms at more threads.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import native


def needs_kernels(*kernel_modules) -> pytest.MarkDecorator:
    """Skip unless this CPU and a C++ compiler can build every given kernel module (its ``available()``)."""
    unavailable = (native.why_unavailable(native._cpu_flags(), "g++") is not None
                   or not all(module.available() for module in kernel_modules))
    return pytest.mark.skipif(unavailable, reason="no AVX2/FMA CPU or no C++ compiler here")


@pytest.fixture
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=list(native.VARIANTS))
def kernel_variant(request, monkeypatch) -> str:
    """Each build of the kernels in turn (native.VARIANTS): avx2, avx512 and the avx512 code through
    SIMDe, forced through ``native.ISA``; skipped, with the reason, where this machine cannot run it
    (a CPU without AVX-512F skips only the native avx512 build: the SIMDe one runs the same source)."""
    reason = native.why_unavailable(native._cpu_flags(), native.compiler(), request.param)
    if reason is not None:
        pytest.skip(f"kernel variant {request.param} cannot run here: {reason}")
    monkeypatch.setattr(native, "ISA", request.param)
    return request.param
