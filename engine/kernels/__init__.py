"""Small native CPU kernels for the decode step, compiled on first use and optional.

``native.load`` builds a C++ source of this package with the system compiler into the cache
directory, in the variant this CPU gets (AVX2, AVX-512, AVX-512 with BF16: ``native.VARIANTS``,
one source per kernel over ``vec.h``), and opens it with ctypes; anything that stops it (no
compiler, no AVX2/FMA, a build error, ``CHUNKSCOPE_NATIVE_KERNELS=0``) logs one line and the
callers keep their torch path.
"""
