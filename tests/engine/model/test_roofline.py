"""The roofline cost model and the dtype choice: pure functions, checked against the real model."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from engine.model.cpu_features import default_dtype, isa_summary, resolve_dtype
from engine.model.loader import load_model
from engine.model.roofline import ForwardCost, MachineRates, forward_cost, gemm_params, measure_rates


def test_gemm_params_count_every_projection_of_the_real_model():
    model, config, _ = load_model("tiny")
    body, head = gemm_params(config)
    # The main model's forward: tiny's MTP module (mtp.*) runs only under speculation = mtp.
    projections = sum(m.weight.numel() for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name != "lm_head" and not name.startswith("mtp."))
    assert body == projections
    assert head == model.lm_head.weight.numel()


def test_roofline_is_the_slower_of_compute_and_memory():
    rates = MachineRates(flops_per_s=1e11, bytes_per_s=1e10)
    assert rates.seconds(ForwardCost(flops=1e11, bytes=1e9)) == pytest.approx(1.0)  # compute-bound
    assert rates.seconds(ForwardCost(flops=1e9, bytes=2e10)) == pytest.approx(2.0)  # memory-bound


def test_decode_is_memory_bound_at_batch_1_and_grows_compute_bound():
    config = load_model("tiny")[1]
    rates = MachineRates(flops_per_s=8e10, bytes_per_s=1.6e10)
    one = forward_cost(config, 4, 0, 0, [32], 1)
    many = forward_cost(config, 4, 0, 0, [32] * 512, 512)
    assert one.bytes / rates.bytes_per_s > one.flops / rates.flops_per_s
    assert many.flops / rates.flops_per_s > many.bytes / rates.bytes_per_s


@given(tokens=st.integers(0, 600), start=st.integers(0, 600), contexts=st.lists(st.integers(1, 600), max_size=40),
       extra=st.integers(1, 64))
def test_cost_grows_with_every_input(tokens, start, contexts, extra):
    """More prefill tokens, more decode rows or longer contexts never cost less."""
    from engine.model.config import ModelConfig
    config = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    if not tokens and not contexts:
        return
    base = forward_cost(config, 4, tokens, start if tokens else 0, contexts, 1)
    for bigger in (forward_cost(config, 4, tokens + extra, start if tokens else 0, contexts, 1),
                   forward_cost(config, 4, tokens, start if tokens else 0, contexts + [extra], 1),
                   forward_cost(config, 4, tokens, start if tokens else 0, [c + extra for c in contexts], 1)):
        assert bigger.flops >= base.flops and bigger.bytes >= base.bytes


def test_measured_rates_are_plausible():
    rates = measure_rates(torch.float32, gemm_size=256, stream_mib=16, repeats=1)
    assert 1e8 < rates.flops_per_s < 1e14 and 1e8 < rates.bytes_per_s < 1e13


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma"}, "float32"),
    ({"avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),
    ({"avx512f"}, "float32"),
    (set(), "float32"),
])
def test_default_dtype_follows_native_bf16_support(flags, expected):
    assert default_dtype(flags) == expected


def test_resolve_dtype_honours_overrides_and_rejects_nonsense():
    assert resolve_dtype("auto", {"amx_bf16"}) == "bfloat16"
    assert resolve_dtype("float32", {"amx_bf16"}) == "float32"
    assert resolve_dtype("bfloat16", {"avx2"}) == "bfloat16"
    assert resolve_dtype("auto", {"amx_bf16"}, device="cuda") == "float32"
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("float16", set())
    assert isa_summary({"avx2", "fma", "sse"}) == "avx2 fma"


def test_engine_records_the_dtype_choice_in_the_run_config():
    from engine.serve.engine_setup import build_engine
    from telemetry.levers import defaults
    auto = build_engine("tiny", kv_blocks=8, ssm_slots=1, levers=defaults(), device="cpu", dtype="auto")
    assert auto.engine_config["dtype_choice"] == "auto"
    assert auto.engine_config["dtype"] == resolve_dtype("auto")
    assert auto.engine_config["cpu_isa"]
    forced = build_engine("tiny", kv_blocks=8, ssm_slots=1, levers=defaults(), device="cpu", dtype="bfloat16")
    assert forced.engine_config["dtype"] == "bfloat16"
    assert next(forced.model.parameters()).dtype == torch.bfloat16


def test_rates_stay_quick_where_a_dtype_has_no_fast_gemm():
    """bf16 without native support multiplies ~100x slower: the probe shrinks its GEMM, not the start."""
    import time
    start = time.perf_counter()
    rates = measure_rates(torch.bfloat16, stream_mib=16, repeats=1)
    assert time.perf_counter() - start < 20
    assert rates.flops_per_s > 0 and rates.bytes_per_s > 1e8
