"""Token counts and inter-token latency, counted in plain numbers, expose what prometheus-client's
own Counter and Histogram would for the same token events."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.api.metric_families import TOKEN_LATENCY_BUCKETS
from engine.api.metrics import EngineMetrics
from telemetry import events as ev


def samples(text: bytes, prefix: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples
            if s.name.startswith(prefix) and not s.name.endswith("_created")}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3_000_000_000)), max_size=60))
def test_token_metrics_match_prometheus_client(steps):
    metrics = EngineMetrics("tiny")
    registry = CollectorRegistry()
    labels = {"model_name": "tiny", "engine": "0"}
    tokens = Counter("vllm:generation_tokens", "Generated tokens", list(labels), registry=registry).labels(**labels)
    itl = Histogram("vllm:inter_token_latency_seconds", "Time between two tokens", list(labels),
                    buckets=TOKEN_LATENCY_BUCKETS, registry=registry).labels(**labels)
    clock, index, last = 0, {}, {}
    for request_id, gap_ns in steps:
        clock += gap_ns
        i = index.get(request_id, 0)
        metrics.observe(ev.TokenEvent(tick=1, t_ns=clock, request_id=request_id, index=i, token_id=7))
        tokens.inc()
        if i > 0:
            itl.observe((clock - last[request_id]) / 1e9)
        index[request_id], last[request_id] = i + 1, clock
    ours, theirs = metrics.exposition(), generate_latest(registry)
    for prefix in ("vllm:generation_tokens", "vllm:inter_token_latency_seconds"):
        mine, reference = samples(ours, prefix), samples(theirs, prefix)
        assert mine.keys() == reference.keys()
        for key, value in reference.items():
            assert abs(mine[key] - value) <= 1e-9 * max(1.0, abs(value)), key
