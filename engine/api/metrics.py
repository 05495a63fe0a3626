"""Prometheus metrics fed from the same typed events the telemetry writer receives.

vLLM's families with vLLM's names, types, labels and buckets (``metric_families.py``), so
Grafana boards built for vLLM work; ours under ``chunkscope:``. ``observe`` runs on the engine
thread beside the writer's ``emit`` (``tee``); a scrape reads the registry from the HTTP
thread (prometheus-client locks). Per-request histograms are observed when a request ends
(as vLLM observes them), the per-token ones in plain numbers (``_TokenCollector``).
"""
from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from engine.api import metric_families as fam
from engine.scheduler.siblings import group_key
from telemetry import events as ev

log = logging.getLogger("chunkscope.api")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The engine's finish reasons -> vLLM's finished_reason label values.
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", ev.REQ_CANCELLED: "abort"}
_END_KINDS = {"finished", ev.REQ_ERROR, ev.REQ_CANCELLED, ev.REQ_PREEMPTED, ev.REQ_REJECTED}
SPEC_STEP = "spec_step"          # the GenericEvent kind engine/spec/spec_step.py emits per step
DEFAULT_MAX_MODEL_LEN = 4096


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

    def __init__(self, labels: list[str], buckets: tuple[float, ...]) -> None:
        self._labels = labels
        self._bounds = buckets
        self.num_tokens = 0
        self._counts = [0] * (len(buckets) + 1)   # per bucket (value <= bound), the last is +Inf
        self._sum = 0.0

    def observe_itl(self, seconds: float) -> None:
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def collect(self):
        name, doc = fam.GENERATION_TOKENS
        tokens = CounterMetricFamily(name, doc, labels=list(fam.LABELS))
        tokens.add_metric(self._labels, self.num_tokens)
        yield tokens
        counts, cumulative, buckets = list(self._counts), 0, []
        for bound, count in zip([*map(str, self._bounds), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        for name, doc in fam.TOKEN_LATENCY.items():   # the deprecated name carries the same observations
            itl = HistogramMetricFamily(name, doc, labels=list(fam.LABELS))
            itl.add_metric(self._labels, buckets, self._sum)
            yield itl


class EngineMetrics:
    def __init__(self, model_name: str, dropped: Callable[[], int] = lambda: 0, *,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, cache_config: dict[str, Any] | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        ours = {"model_name": model_name}
        vllm = {"model_name": model_name, "engine": fam.ENGINE_INDEX}
        self._ours, self._vllm = ours, vllm

        def gauge(name, doc, labels=vllm):
            return Gauge(name, doc, list(labels), registry=registry).labels(**labels)

        def counter(name, doc, extra=(), labels=vllm):
            metric = Counter(name, doc, [*labels, *extra], registry=registry)
            return metric if extra else metric.labels(**labels)

        self.gauges = {name: gauge(name, doc) for name, doc in fam.GAUGES.items()}
        self.counters = {name: counter(name, doc) for name, doc in fam.COUNTERS.items()}
        self.success = counter(*fam.REQUEST_SUCCESS, ("finished_reason",))
        self.accepted_per_pos = counter(*fam.ACCEPTED_PER_POS, ("position",))
        self.histograms = {name: Histogram(name, doc, list(vllm), buckets=buckets, registry=registry).labels(**vllm)
                           for name, (doc, buckets) in fam.histograms(max_model_len).items()}
        if cache_config:
            info = {**{k: str(v) for k, v in cache_config.items()}, "engine": fam.ENGINE_INDEX}
            Gauge(fam.CACHE_CONFIG_INFO[0], fam.CACHE_CONFIG_INFO[1], list(info), registry=registry).labels(**info).set(1)
        self.ssm_slots = gauge("chunkscope:ssm_slots_used", "SSM state slots in use", ours)
        self.chunks = counter("chunkscope:chunks", "Prefill chunks by path and cap rule", ("path", "cap_rule"), ours)
        self.mix_blocked = counter("chunkscope:mix_blocked", "Chunks whose mixing was blocked, by blocker",
                                   ("blocker",), ours)
        self.first_token_rules = counter("chunkscope:first_token_rules", "First-token rules fired", ("rule",), ours)
        self.preemptions = counter("chunkscope:preemptions", "Preemptions by victim policy", ("policy",), ours)
        self.lever_changes = counter("chunkscope:lever_changes", "Lever changes by status and source",
                                     ("status", "source"), ours)
        self.failed = counter("chunkscope:requests_failed", "Requests ended without finishing", ("status",), ours)
        self.approximations = counter("chunkscope:grammar_approximations",
                                      "Grammars compiled leniently, by the schema keyword they ignored", ("keyword",),
                                      ours)
        self.truncations = counter("chunkscope:grammar_truncations",
                                   "Grammar-constrained requests cut by max_tokens before their grammar was complete",
                                   ("grammar_kind",), ours)
        registry.register(_DroppedCollector(dropped))
        self.tokens = _TokenCollector(list(vllm.values()), fam.TOKEN_LATENCY_BUCKETS)
        registry.register(self.tokens)
        self._last_kind: str | None = None
        self._failed = False
        self._last_token_ns: dict[int, int] = {}
        self._groups: dict[int, list[int]] = {}    # a sibling group's first id -> [choices left, longest output]

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
            self._set_usage(event.num_active + event.num_prefilling, event.num_waiting, event.kv_blocks_used,
                            event.kv_blocks_total)
            computed = event.num_prefill_tokens + event.num_decode_tokens
            if computed:
                self.histograms["vllm:iteration_tokens_total"].observe(computed)
        elif kind is ev.RequestEvent:
            self._last_kind = event.kind
        elif kind is ev.RequestRecord:
            self._on_request(self._last_kind, event)
        elif kind is ev.ChunkDecision:
            self._on_chunk(event)
        elif kind is ev.Preemption:
            self.preemptions.labels(**self._ours, policy=event.policy).inc()
            self.counters["vllm:num_preemptions"].inc()
        elif kind is ev.LeverChange:
            self.lever_changes.labels(**self._ours, status=event.status, source=event.source).inc()
        elif kind is ev.GenericEvent and event.kind == SPEC_STEP:
            self._on_spec_step(event.detail or {})

    def _on_chunk(self, event: ev.ChunkDecision) -> None:
        self.chunks.labels(**self._ours, path=event.path, cap_rule=event.cap_rule).inc()
        if event.mix_blocker is not None:
            self.mix_blocked.labels(**self._ours, blocker=event.mix_blocker).inc()
        for rule in (event.first_token_rules or "").split(","):
            if rule:
                self.first_token_rules.labels(**self._ours, rule=rule).inc()

    def _on_spec_step(self, detail: dict) -> None:
        drafted, accepted = int(detail.get("num_drafted", 0)), int(detail.get("num_accepted", 0))
        if not drafted:
            return
        self.counters["vllm:spec_decode_num_drafts"].inc()
        self.counters["vllm:spec_decode_num_draft_tokens"].inc(drafted)
        self.counters["vllm:spec_decode_num_accepted_tokens"].inc(accepted)
        for position in range(drafted):   # accepted drafts are a prefix of the draft
            self.accepted_per_pos.labels(**self._vllm, position=str(position)).inc(int(position < accepted))

    def _on_request(self, kind: str | None, row: ev.RequestRecord) -> None:
        if kind == "admitted":
            self.counters["vllm:prefix_cache_queries"].inc(row.prompt_len)
            self.counters["vllm:prefix_cache_hits"].inc(row.prefix_hit_tokens)
        elif kind == "grammar_ready":
            for keyword in (row.grammar_approximations or "").split(","):
                if keyword:
                    self.approximations.labels(**self._ours, keyword=keyword).inc()
        elif kind == "first_token":
            self.histograms["vllm:time_to_first_token_seconds"].observe((row.first_token_ns - row.arrival_ns) / 1e9)
            self.counters["vllm:prompt_tokens"].inc(row.prompt_len)
        elif kind in _END_KINDS:
            self._on_end(row)

    def _on_end(self, row: ev.RequestRecord) -> None:
        self._last_token_ns.pop(row.request_id, None)
        reason = FINISHED_REASON.get(row.finish_reason or "")
        if row.status in (ev.REQ_FINISHED, ev.REQ_CANCELLED) and reason is not None:
            self.success.labels(**self._vllm, finished_reason=reason).inc()
        else:
            self.failed.labels(**self._ours, status=row.status).inc()
        if row.grammar_kind is not None and row.finish_reason == "length" and not row.grammar_valid:
            self.truncations.labels(**self._ours, grammar_kind=row.grammar_kind).inc()
        if row.status == ev.REQ_FINISHED:
            self._observe_finished(row)
        self._observe_group(row)

    def _observe_finished(self, row: ev.RequestRecord) -> None:
        """vLLM's per-request histograms (seconds from the row's monotonic ns)."""
        h = self.histograms
        arrival, admitted, first, end = row.arrival_ns, row.admitted_ns, row.first_token_ns, row.finished_ns
        h["vllm:e2e_request_latency_seconds"].observe((end - arrival) / 1e9)
        h["vllm:request_prompt_tokens"].observe(row.prompt_len)
        h["vllm:request_generation_tokens"].observe(row.output_len)
        if row.sampling.get("max_tokens"):
            h["vllm:request_params_max_tokens"].observe(row.sampling["max_tokens"])
        if admitted is None or first is None:
            return
        h["vllm:request_queue_time_seconds"].observe((admitted - arrival) / 1e9)
        h["vllm:request_prefill_time_seconds"].observe((first - admitted) / 1e9)
        h["vllm:request_decode_time_seconds"].observe((end - first) / 1e9)
        h["vllm:request_inference_time_seconds"].observe((end - admitted) / 1e9)
        if row.output_len > 1:
            h["vllm:request_time_per_output_token_seconds"].observe((end - first) / 1e9 / (row.output_len - 1))

    def _observe_group(self, row: ev.RequestRecord) -> None:
        """``n`` and the longest output of an API request, once all its choices have ended."""
        n, choice = int(row.features.get("n", 1)), int(row.features.get("choice", 0))
        key = group_key(row.request_id, n, choice)
        left, longest = self._groups.pop(key, [n, 0])
        left, longest = left - 1, max(longest, row.output_len)
        if left > 0:
            self._groups[key] = [left, longest]
            return
        self.histograms["vllm:request_params_n"].observe(n)
        self.histograms["vllm:request_max_num_generation_tokens"].observe(longest)

    def _set_usage(self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int) -> None:
        g = self.gauges
        g["vllm:num_requests_running"].set(num_running)
        g["vllm:num_requests_waiting"].set(num_waiting)
        usage = kv_blocks_used / kv_blocks_total if kv_blocks_total else 0.0
        g["vllm:kv_cache_usage_perc"].set(usage)
        g["vllm:gpu_cache_usage_perc"].set(usage)

    def set_state(self, *, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int,
                  ssm_slots_used: int) -> None:
        """The gauges as the loop sees them between ticks (a Tick event sets them too)."""
        self._set_usage(num_running, num_waiting, kv_blocks_used, kv_blocks_total)
        self.ssm_slots.set(ssm_slots_used)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
