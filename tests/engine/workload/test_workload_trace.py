"""Trace replay: CSV parsing, scale factors, slices, bad input."""
from pathlib import Path

import pytest

from engine.workload.request import WorkloadError
from engine.workload.trace import AZURE_CITATION, TraceWorkload, read_trace

# The shared trace sits beside the checkout (../shared), in CI as here.
AZURE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "azure_conv_2023.csv"

SMALL = """TIMESTAMP, ContextTokens, GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:56.3910170,3,1
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(SMALL)
    return path


def test_reads_offsets_and_lengths(small):
    rows = read_trace(small)
    assert [r[1:] for r in rows] == [(374, 44), (396, 109), (879, 55), (91, 16), (3, 1)]
    assert rows[0][0] == 0.0 and rows[1][0] == pytest.approx(4.314579)
    assert rows[4][0] == pytest.approx(9.710427)


def test_unscaled_replay_keeps_times_and_lengths(small):
    specs = TraceWorkload(small, vocab_size=100).requests()
    assert [s.prompt_len for s in specs] == [374, 396, 879, 91, 3]
    assert [s.max_tokens for s in specs] == [44, 109, 55, 16, 1]
    assert [s.sampling["min_tokens"] for s in specs] == [44, 109, 55, 16, 1]
    assert specs[3].arrival_s == pytest.approx(4.710427)


def test_scale_factors_apply_to_every_gap_and_length(small):
    base = TraceWorkload(small, vocab_size=100).requests()
    scaled = TraceWorkload(small, vocab_size=100, time_scale=0.25, length_scale=0.1).requests()
    for b, s in zip(base, scaled):
        assert s.arrival_s == pytest.approx(b.arrival_s * 0.25)
        assert s.prompt_len == max(1, round(b.prompt_len * 0.1))
        assert s.max_tokens == max(1, round(b.max_tokens * 0.1))
    assert scaled[4].prompt_len == 1 and scaled[4].max_tokens == 1  # never below 1
    d = TraceWorkload(small, vocab_size=100, time_scale=0.25, length_scale=0.1).describe()
    assert (d["time_scale"], d["length_scale"], d["num_requests"]) == (0.25, 0.1, 5)
    assert d["duration_s"] == pytest.approx(9.710427 * 0.25, abs=1e-5)


def test_slice_starts_at_zero_and_caps_prompts(small):
    specs = TraceWorkload(small, vocab_size=100, start=1, limit=2, max_prompt_len=400).requests()
    assert [s.prompt_len for s in specs] == [396, 400]
    assert specs[0].arrival_s == 0.0 and specs[1].arrival_s == pytest.approx(0.227298)


def test_seeded_prompts(small):
    a = TraceWorkload(small, vocab_size=50, excluded_ids={0}, seed=1).requests()
    assert a == TraceWorkload(small, vocab_size=50, excluded_ids={0}, seed=1).requests()
    assert a != TraceWorkload(small, vocab_size=50, excluded_ids={0}, seed=2).requests()
    assert all(0 < t < 50 for s in a for t in s.prompt_tokens)


def test_mixed_sampling_option(small):
    specs = TraceWorkload(small, vocab_size=50, greedy_fraction=0.0).requests()
    assert all(s.sampling["temperature"] > 0 for s in specs)


@pytest.mark.parametrize("text, message", [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n", "missing column 'GeneratedTokens'"),
    ("", "missing column 'TIMESTAMP'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no request rows"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "line 2: TIMESTAMP 'yesterday'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,4\n", "line 2: ContextTokens 'x'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,-4\n", "GeneratedTokens -4 is negative"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3\n", "line 2: 2 fields"),
])
def test_bad_files_name_file_and_column(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message) as info:
        TraceWorkload(path, vocab_size=10)
    assert str(path) in str(info.value)


def test_missing_file_and_bad_options(tmp_path, small):
    with pytest.raises(WorkloadError, match="nope.csv: cannot open"):
        TraceWorkload(tmp_path / "nope.csv", vocab_size=10)
    with pytest.raises(WorkloadError, match="time_scale"):
        TraceWorkload(small, vocab_size=10, time_scale=0)
    with pytest.raises(WorkloadError, match="length_scale"):
        TraceWorkload(small, vocab_size=10, length_scale=-1)
    with pytest.raises(WorkloadError, match="start 5 is past its 5 rows"):
        TraceWorkload(small, vocab_size=10, start=5)
    with pytest.raises(WorkloadError, match="limit"):
        TraceWorkload(small, vocab_size=10, limit=0)


@pytest.mark.skipif(not AZURE.exists(), reason="shared Azure trace not present")
def test_azure_trace_slice_keeps_its_shape():
    w = TraceWorkload(AZURE, vocab_size=1000, time_scale=0.1, length_scale=0.25, limit=500)
    d = w.describe()
    assert d["num_trace_rows"] == 19366 and d["num_requests"] == 500 and d["source"] == AZURE_CITATION
    assert d["duration_s"] == pytest.approx(d["trace_duration_s"] * 0.1, rel=1e-6)
    full = TraceWorkload(AZURE, vocab_size=1000, limit=500).requests()
    scaled = w.requests()
    ratio_full = sum(s.prompt_len for s in full) / sum(s.max_tokens for s in full)
    ratio_scaled = sum(s.prompt_len for s in scaled) / sum(s.max_tokens for s in scaled)
    assert ratio_scaled == pytest.approx(ratio_full, rel=0.02)
