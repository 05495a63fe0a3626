"""The roofline cost model and the dtype choice: pure functions, checked against the real model."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from engine.model.cpu_features import default_dtype, isa_summary, resolve_dtype
from engine.model.loader import load_model
from engine.model.roofline import (ForwardCost, MachineRates, RateProbe, best_rates, forward_cost, gemm_flops,
                                   gemm_params, measure_rates)


def test_gemm_params_count_every_projection_of_the_real_model():
    model, config, _ = load_model("tiny")
    body, head = gemm_params(config)
    # The main model's forward: tiny's MTP module (mtp.*) runs only under speculation = mtp.
    projections = sum(m.weight.numel() for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name != "lm_head" and not name.startswith("mtp."))
    assert body == projections
    assert head == model.lm_head.weight.numel()


SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16)  # layers 0-2 linear attention, 3 full


def test_cost_of_a_small_config_is_the_hand_count():
    """FLOPs and bytes worked out by hand, so a change to the model cannot move them unnoticed.

    Per full-attention layer: q + gate 64*64*2 = 8192, k + v 2*64*32 = 4096, o 64*64 = 4096: 16,384.
    Per GDN layer: in 64*(conv 128 + z 64 + a, b 2*4) = 12,800, out 64*64 = 4,096: 16,896.
    MLP 3*64*128 = 24,576 per layer. Body 16,384 + 3*16,896 + 4*24,576 = 165,376; LM head 300*64 = 19,200.
    Recurrent state 4 heads * 16 * 16 = 1,024 values per GDN layer, conv window 128*3 = 384.
    """
    from engine.model.config import ModelConfig
    config = ModelConfig(**SMALL)
    assert gemm_params(config) == (165_376, 19_200)
    # Decode, rows at contexts 10 and 20, fp32: GEMMs 2*2*(165,376 + 19,200) = 738,304; attention 4 * q width 64 *
    # 30 visible keys * 1 layer = 7,680; GDN 6 * 1,024 * 3 layers * 2 rows = 36,864.
    decode = forward_cost(config, 4, 0, 0, [10, 20], 2)
    assert decode.flops == 738_304 + 7_680 + 36_864
    # Weights (165,376 + 19,200) * 4 = 738,304; K/V read 30 * 64 * 4 = 7,680, written 2 * 64 * 4 = 512;
    # each sequence's states read and written: 2 * 2 * (1,024 + 384) * 3 layers * 4 bytes = 67,584.
    assert decode.bytes == 738_304 + 7_680 + 512 + 67_584
    # Prefill of 8 tokens, logits for the last only: 7 rows stop before the last MLP (24,576) and the head.
    # GEMMs 2*8*(165,376 - 24,576) + 2*1*(24,576 + 19,200) = 2,252,800 + 87,552; attention 4*64*36 = 9,216
    # (8*9/2 causal keys); GDN 6*1,024*3*8 = 147,456. Bytes: weights 738,304, K/V written 8*64*4 = 2,048,
    # one sequence's states 2 * 16,896 = 33,792.
    prefill = forward_cost(config, 4, 8, 0, [], 1)
    assert prefill.flops == 2_252_800 + 87_552 + 9_216 + 147_456
    assert prefill.bytes == 738_304 + 2_048 + 33_792
    # A chunk with no logits row reads neither the last MLP's weights nor the head's.
    assert forward_cost(config, 2, 8, 0, [], 0).bytes == (165_376 - 24_576) * 2 + 8 * 64 * 2 + 33_792


@pytest.fixture(scope="module")
def counted_forwards():
    """Real forwards of tiny and tiny-moe on the torch paths (native kernels and oneDNN off, so torch's FLOP
    counter sees every GEMM): per model, (runner's recorded cost, counted FLOPs by op) of a 20-token prefill
    and of a decode step of 3 rows."""
    from torch.utils.flop_counter import FlopCounterMode
    from engine.cache.sequence import SequenceState
    from engine.kernels import native
    from engine.model import layers
    from engine.model.runner import ModelRunner
    saved = native.ENABLED, layers.PREPACK_ENABLED
    native.ENABLED, layers.PREPACK_ENABLED = False, False
    try:
        found = {}
        for name in ("tiny", "tiny-moe"):
            model, config, _ = load_model(name)
            runner = ModelRunner.build(model, num_kv_blocks=12, num_ssm_slots=3)
            seqs, runs = [SequenceState(i) for i in range(3)], []
            for seq in seqs:
                runner.pools.admit(seq)
            for forward in (lambda: runner.prefill_chunk(seqs[0], list(range(1, 21)), 0, 20, True),
                            lambda: [runner.prefill_chunk(s, [5, 6, 7], 0, 3, True) for s in seqs[1:]],
                            lambda: runner.decode(seqs, [1, 2, 3])):
                with FlopCounterMode(display=False) as counter:
                    forward()
                counted = counter.get_flop_counts()["Global"]
                runs.append((runner.take_forward_cost(), {str(op): flops for op, flops in counted.items()}))
            found[name] = (config, runs[0], runs[2])
        return found
    finally:
        native.ENABLED, layers.PREPACK_ENABLED = saved


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_roofline_counts_no_flop_the_forward_skips(counted_forwards, name):
    """A share cannot pass 100% by counting: the GEMM FLOPs the roofline charges are exactly the projections
    and LM head torch's counter sees the real forward run (a 20-token prefill with one logits row, whose
    last-layer MLP runs that row alone, and a decode step), and its total is no more than the counted
    FLOPs plus the GDN's elementwise recurrence, which the counter does not see."""
    config, prefill, decode = counted_forwards[name]
    for (cost, counted), tokens, rows in ((prefill, 20, 1), (decode, 3, 3)):
        assert counted["aten.mm"] + counted.get("aten.addmm", 0) == gemm_flops(config, tokens, rows)
        recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        assert cost.flops <= sum(counted.values()) + 6 * recurrent * len(config.linear_attention_layers) * tokens


def test_probe_rate_is_the_fastest_library_gemm():
    """The compute ceiling is the fastest square GEMM torch offers, not MKL's alone: on a Zen 5 EPYC MKL's fp32
    GEMM ran its AVX2 path at ~100 GFLOP/s while oneDNN's ran ~250 and the decode GEMMs ~200 (shares of 152%)."""
    probe = RateProbe(torch.float32, gemm_size=256, stream_mib=4)
    assert "mm" in probe.gemms
    ticks = iter(range(10_000))
    probe.clock = lambda: next(ticks)  # every timed call takes 1 tick ...
    slow = probe.gemms["mm"]
    probe.gemms["mm"] = lambda: (next(ticks), slow())  # ... torch.mm's 2
    rate = probe.sample()
    if "onednn" in probe.gemms:
        assert rate.gemm == "onednn" and rate.flops_per_s == probe.gemm_flops
    else:
        assert rate.gemm == "mm" and rate.flops_per_s == probe.gemm_flops / 2
    best = best_rates([MachineRates(1e9, 5e9, "mm"), MachineRates(3e9, 1e9, "onednn")])
    assert best == MachineRates(3e9, 5e9, "onednn")


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
