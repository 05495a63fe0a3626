"""Which dtype a replay computes in, and on which CPU: the recorded run's own dtype, refused in one line
where this machine cannot run it, and both sides written into the report.

A replay in another dtype than the recording's cannot be expected to give its tokens, so the replay
never picks its own (``auto`` was resolved once, when the run started, and recorded as ``dtype``).
"""
from __future__ import annotations

from typing import Any

import torch

from engine.model.cpu_features import cpu_flags, cpu_model, isa_summary
from engine.replay.record import ReplayInputError

REPLAYABLE_DTYPES = ("float32", "bfloat16")
LEGACY_DTYPE = "float32"  # runs recorded before the config carried a dtype all computed in fp32


def replay_dtype(config: dict[str, Any], device: str, *, cuda_bf16: bool | None = None) -> str:
    """The recorded dtype, checked against ``device``; ``cuda_bf16`` overrides the CUDA probe (tests)."""
    dtype = str(config.get("dtype") or LEGACY_DTYPE)
    if dtype not in REPLAYABLE_DTYPES:
        raise ReplayInputError(f"the run computed in dtype {dtype!r}, which this engine cannot replay "
                               f"(it runs {', '.join(REPLAYABLE_DTYPES)})")
    if dtype == "bfloat16" and device.startswith("cuda"):
        supported = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        if not supported:
            raise ReplayInputError(f"the run computed in bfloat16, which CUDA device {device} cannot run "
                                   f"(replay it on a CPU, or on a GPU with bf16)")
    return dtype


def numerics(config: dict[str, Any], dtype: str, device: str) -> dict[str, Any]:
    """The report's ``numerics``: the recording's dtype and CPU next to the replay's."""
    return {"recorded": {"dtype": config.get("dtype") or LEGACY_DTYPE, "cpu_model": config.get("cpu_model"),
                         "cpu_isa": config.get("cpu_isa")},
            "replayed": {"dtype": dtype, "device": device, "cpu_model": cpu_model(),
                         "cpu_isa": isa_summary(cpu_flags())}}


def numerics_line(report: dict[str, Any]) -> str:
    """'numerics: replayed in bfloat16 on AMD EPYC 9B14 (avx2 fma avx512f avx512_bf16); recorded in ...'."""
    def side(entry: dict[str, Any]) -> str:
        cpu = entry.get("cpu_model") or "an unrecorded CPU"
        return f"{entry['dtype']} on {cpu}" + (f" ({entry['cpu_isa']})" if entry.get("cpu_isa") else "")

    recorded, replayed = report["recorded"], report["replayed"]
    return f"numerics:  replayed in {side(replayed)}; recorded in {side(recorded)}"
