"""Prometheus metrics fed from the same typed events the telemetry writer receives.

vLLM's names where the meaning is the same (so existing Grafana boards work), ours under
``chunkscope:``. ``observe`` runs on the engine thread beside the writer's ``emit``
(``tee``); a scrape reads the registry from the HTTP thread (prometheus-client locks).
"""
from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from telemetry import events as ev

log = logging.getLogger("chunkscope.api")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The engine's finish reasons -> vLLM's finished_reason label values.
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", ev.REQ_CANCELLED: "abort"}
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_END_KINDS = {"finished", ev.REQ_ERROR, ev.REQ_CANCELLED, ev.REQ_PREEMPTED, ev.REQ_REJECTED}


class _DroppedCollector:
    """Telemetry events dropped by a failing store, read from the writer at scrape time."""

    def __init__(self, dropped: Callable[[], int]) -> None:
        self._dropped = dropped

    def collect(self):
        family = CounterMetricFamily("chunkscope:telemetry_events_dropped",
                                     "Telemetry events dropped while the store was failing")
        family.add_metric([], self._dropped())
        yield family


class _TokenCollector:
    """Generated tokens and inter-token latency, kept as plain numbers on the engine thread and
    turned into metric families at scrape time: a prometheus-client ``inc`` and ``observe`` per
    token (locks, label lookups) cost ~10 us each on the thread the tick loop runs on."""

    def __init__(self, model_name: str, buckets: tuple[float, ...]) -> None:
        self._model_name = model_name
        self._bounds = buckets
        self.num_tokens = 0
        self._counts = [0] * (len(buckets) + 1)   # per bucket (value <= bound), the last is +Inf
        self._sum = 0.0

    def observe_itl(self, seconds: float) -> None:
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def collect(self):
        tokens = CounterMetricFamily("vllm:generation_tokens", "Generated tokens", labels=["model_name"])
        tokens.add_metric([self._model_name], self.num_tokens)
        yield tokens
        counts, cumulative, buckets = list(self._counts), 0, []
        for bound, count in zip([*map(str, self._bounds), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        itl = HistogramMetricFamily("vllm:inter_token_latency_seconds", "Time between two tokens",
                                    labels=["model_name"])
        itl.add_metric([self._model_name], buckets, self._sum)
        yield itl


class EngineMetrics:
    def __init__(self, model_name: str, dropped: Callable[[], int] = lambda: 0) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=registry).labels(**labels)

        def counter(name, doc, extra=()):
            metric = Counter(name, doc, [*labels, *extra], registry=registry)
            return metric if extra else metric.labels(**labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, list(labels), buckets=buckets, registry=registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests prefilling or decoding")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)")
        self.ssm_slots = gauge("chunkscope:ssm_slots_used", "SSM state slots in use")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that reached token 0")
        self.success = counter("vllm:request_success", "Requests ended, by finished reason", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to token 0", _LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to end of finished requests",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to admission", _LATENCY_BUCKETS)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.chunks = counter("chunkscope:chunks", "Prefill chunks by path and cap rule", ("path", "cap_rule"))
        self.mix_blocked = counter("chunkscope:mix_blocked", "Chunks whose mixing was blocked, by blocker",
                                   ("blocker",))
        self.first_token_rules = counter("chunkscope:first_token_rules", "First-token rules fired", ("rule",))
        self.preemptions = counter("chunkscope:preemptions", "Preemptions by victim policy", ("policy",))
        self.lever_changes = counter("chunkscope:lever_changes", "Lever changes by status and source",
                                     ("status", "source"))
        self.failed = counter("chunkscope:requests_failed", "Requests ended without finishing", ("status",))
        registry.register(_DroppedCollector(dropped))
        self.tokens = _TokenCollector(model_name, _ITL_BUCKETS)
        registry.register(self.tokens)
        self._last_kind: str | None = None
        self._failed = False
        self._last_token_ns: dict[int, int] = {}

    def tee(self, emit: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """An emit function that feeds these metrics, then ``emit`` (the writer's) when there is one.

        A metrics bug must never stop the tick loop: it is logged once and the metrics go on."""
        def both(event: Any) -> None:
            try:
                self.observe(event)
            except Exception:
                if not self._failed:
                    log.exception("metrics: observing %s failed (logged once; serving goes on)", type(event).__name__)
                    self._failed = True
            if emit is not None:
                emit(event)
        return both

    def observe(self, event: Any) -> None:
        kind = type(event)
        if kind is ev.TokenEvent:
            self.tokens.num_tokens += 1
            last = self._last_token_ns.get(event.request_id)
            if last is not None and event.index > 0:
                self.tokens.observe_itl((event.t_ns - last) / 1e9)
            self._last_token_ns[event.request_id] = event.t_ns
        elif kind is ev.Tick:
            self.running.set(event.num_active + event.num_prefilling)
            self.waiting.set(event.num_waiting)
            self.kv_usage.set(event.kv_blocks_used / event.kv_blocks_total if event.kv_blocks_total else 0.0)
        elif kind is ev.RequestEvent:
            self._last_kind = event.kind
        elif kind is ev.RequestRecord:
            self._on_request(self._last_kind, event)
        elif kind is ev.ChunkDecision:
            self._on_chunk(event)
        elif kind is ev.Preemption:
            self.preemptions.labels(**self._labels, policy=event.policy).inc()
        elif kind is ev.LeverChange:
            self.lever_changes.labels(**self._labels, status=event.status, source=event.source).inc()

    def _on_chunk(self, event: ev.ChunkDecision) -> None:
        self.chunks.labels(**self._labels, path=event.path, cap_rule=event.cap_rule).inc()
        if event.mix_blocker is not None:
            self.mix_blocked.labels(**self._labels, blocker=event.mix_blocker).inc()
        for rule in (event.first_token_rules or "").split(","):
            if rule:
                self.first_token_rules.labels(**self._labels, rule=rule).inc()

    def _on_request(self, kind: str | None, row: ev.RequestRecord) -> None:
        if kind == "admitted":
            self.queue_time.observe((row.admitted_ns - row.arrival_ns) / 1e9)
            self.prefix_queries.inc(row.prompt_len)
            self.prefix_hits.inc(row.prefix_hit_tokens)
        elif kind == "first_token":
            self.ttft.observe((row.first_token_ns - row.arrival_ns) / 1e9)
            self.prompt_tokens.inc(row.prompt_len)
        elif kind in _END_KINDS:
            self._last_token_ns.pop(row.request_id, None)
            reason = FINISHED_REASON.get(row.finish_reason or "")
            if row.status == ev.REQ_FINISHED:
                self.e2e.observe((row.finished_ns - row.arrival_ns) / 1e9)
            if row.status in (ev.REQ_FINISHED, ev.REQ_CANCELLED) and reason is not None:
                self.success.labels(**self._labels, finished_reason=reason).inc()
            else:
                self.failed.labels(**self._labels, status=row.status).inc()

    def set_state(self, *, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
                  ssm_slots_used: int) -> None:
        """The gauges as the loop sees them between ticks (a Tick event sets them too)."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0)
        self.ssm_slots.set(ssm_slots_used)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
