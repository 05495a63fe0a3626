"""CHUNKSCOPE_ASSUME_CPU: one machine exercises both ``--dtype auto`` defaults (issue 26).

The hook must change only the dtype ``auto`` picks, be recorded on the run, and refuse an unknown
value instead of silently reading this CPU's flags."""
from __future__ import annotations

import pytest

from engine.model import cpu_features
from engine.serve.engine_setup import build_engine
from telemetry.levers import defaults


@pytest.mark.parametrize("kind, dtype", [("amx", "bfloat16"), ("avx2", "float32")])
def test_auto_resolves_as_the_assumed_cpu_would(monkeypatch, kind, dtype):
    monkeypatch.setenv(cpu_features.ASSUME_CPU_ENV, kind)
    assert cpu_features.resolve_dtype("auto") == dtype
    # an explicit choice is never overridden, and the kernels' flags stay this CPU's own
    assert cpu_features.resolve_dtype("float32") == "float32"
    assert cpu_features.cpu_flags() == set(open("/proc/cpuinfo").read().split("flags")[1]
                                           .split(":", 1)[1].splitlines()[0].split())


def test_without_the_hook_auto_reads_this_cpu(monkeypatch):
    monkeypatch.delenv(cpu_features.ASSUME_CPU_ENV, raising=False)
    assert cpu_features.assumed_cpu() is None
    assert cpu_features.resolve_dtype("auto") == cpu_features.default_dtype(cpu_features.cpu_flags())


def test_an_unknown_kind_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_features.ASSUME_CPU_ENV, "sparc")
    with pytest.raises(ValueError, match="CHUNKSCOPE_ASSUME_CPU must be one of amx, avx2, got 'sparc'"):
        cpu_features.resolve_dtype("auto")


def test_the_engine_runs_and_records_the_assumed_default(monkeypatch):
    monkeypatch.setenv(cpu_features.ASSUME_CPU_ENV, "amx")
    setup = build_engine("tiny", kv_blocks=16, ssm_slots=2, levers=defaults(), dtype="auto")
    assert setup.engine_config["dtype"] == "bfloat16"
    assert setup.engine_config["dtype_assumed_cpu"] == "amx"
    assert str(next(setup.model.parameters()).dtype) == "torch.bfloat16"
