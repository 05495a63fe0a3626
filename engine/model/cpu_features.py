"""What this CPU is and which dtype fits it: read from /proc/cpuinfo, decided by a pure function."""
from __future__ import annotations

import os
import platform

# bf16 pays off where the CPU multiplies bf16 natively: AMX tiles or AVX512-BF16 dot products.
# Elsewhere (AVX2 EPYC, older Xeons) oneDNN widens bf16 to fp32 for the multiply, and the halved
# weight bytes do not buy back the conversions.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
# A test hook: CHUNKSCOPE_ASSUME_CPU=amx makes ``auto`` resolve as it would on a Sapphire Rapids
# Xeon, =avx2 as on an AVX2-only EPYC, so one machine exercises both defaults (.ci/run uses it).
# It changes only the dtype choice, never which kernels run.
ASSUME_CPU_ENV = "CHUNKSCOPE_ASSUME_CPU"
ASSUMED_FLAGS = {
    "amx": {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"},
    "avx2": {"avx2", "fma"},
}


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle if line.startswith(name)), None)
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's model name and x86 family / model numbers (e.g. 'AMD EPYC (family 26, model 2)'),
    else the platform's best guess. A hypervisor may mask the name ('AMD EPYC' on Zen 4 and Zen 5
    alike); the family tells them apart (25: Zen 3 / Zen 4, 26: Zen 5, whose full-width AVX-512
    doubles the fp32 FMA rate of one core)."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model\t")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_flags() -> set[str]:
    """The instruction-set flags of the first CPU ('avx2', 'amx_bf16', ...); empty where unknown."""
    return set((_cpuinfo_field("flags") or "").split())


def assumed_cpu() -> str | None:
    """The CPU kind the test hook stands in for, or None; an unknown value is an error, not ignored."""
    kind = os.environ.get(ASSUME_CPU_ENV, "").strip().lower()
    if not kind:
        return None
    if kind not in ASSUMED_FLAGS:
        raise ValueError(f"{ASSUME_CPU_ENV} must be one of {', '.join(ASSUMED_FLAGS)}, got {kind!r}")
    return kind


def dtype_flags() -> set[str]:
    """The flags ``auto`` decides on: the hook's stand-in CPU where it is set, else this CPU's."""
    kind = assumed_cpu()
    return set(ASSUMED_FLAGS[kind]) if kind else cpu_flags()


def default_dtype(flags: set[str]) -> str:
    """'bfloat16' on a CPU with native bf16 multiplies (AMX or AVX512-BF16), else 'float32'."""
    return "bfloat16" if any(flag in flags for flag in BF16_FLAGS) else "float32"


def resolve_dtype(choice: str, flags: set[str] | None = None, device: str = "cpu") -> str:
    """The dtype a run uses: ``choice`` unless it is 'auto' (then ``default_dtype`` on CPU, fp32 on others)."""
    if choice not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice
    if not device.startswith("cpu"):
        return "float32"
    return default_dtype(dtype_flags() if flags is None else flags)


def isa_summary(flags: set[str]) -> str:
    """The flags that decide GEMM speed and the dtype, e.g. 'avx2 fma' or 'avx512f amx_bf16'."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(flag for flag in wanted if flag in flags) or "unknown"
