"""/metrics parses as Prometheus text and its counters equal what the telemetry store recorded."""
from __future__ import annotations

from collections import Counter

from test_api_cancel_errors import metric_values, pools_free
from serve_process import wait_for

FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


def store_counts(server) -> dict:
    rows = server.rows("SELECT status, finish_reason, prompt_len, first_token_ns FROM requests")
    success = Counter(FINISHED_REASON[r["finish_reason"]] for r in rows if r["status"] in ("finished", "cancelled"))
    chunks = {(r["path"], r["cap_rule"]): r["n"] for r in server.rows(
        "SELECT path, cap_rule, count(*) AS n FROM chunks GROUP BY path, cap_rule")}
    rules = Counter(rule for r in server.rows(
        "SELECT first_token_rules FROM chunks WHERE first_token_rules IS NOT NULL")
                    for rule in r["first_token_rules"].split(","))
    return {"generation": server.rows("SELECT count(*) AS n FROM tokens")[0]["n"],
            "prompt": sum(r["prompt_len"] for r in rows if r["first_token_ns"] is not None),
            "ttft": sum(1 for r in rows if r["first_token_ns"] is not None),
            "success": dict(success), "chunks": chunks, "rules": dict(rules)}


def scraped_counts(server) -> dict:
    m = metric_values(server)

    def by(name, label):
        return {dict(labels)[label]: int(v) for (n, labels), v in m.items() if n == name and v}

    return {"generation": int(m[("vllm:generation_tokens_total", ())]),
            "prompt": int(m[("vllm:prompt_tokens_total", ())]),
            "ttft": int(m[("vllm:time_to_first_token_seconds_count", ())]),
            "success": by("vllm:request_success_total", "finished_reason"),
            "chunks": {(dict(labels)["path"], dict(labels)["cap_rule"]): int(v) for (n, labels), v in m.items()
                       if n == "chunkscope:chunks_total"},
            "rules": by("chunkscope:first_token_rules_total", "rule")}


def test_metrics_agree_with_the_store(api_server):
    client = api_server.client()
    client.completions.create(model="tiny", prompt="metrics", max_tokens=5, temperature=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    wait_for(lambda: pools_free(api_server), "an idle engine")
    # The writer flushes every ~100 ms: wait until the store has caught up with the scrape.
    scraped = scraped_counts(api_server)
    wait_for(lambda: store_counts(api_server) == scraped, "the store to equal /metrics", timeout_s=10)
    assert scraped["generation"] > 0 and scraped["success"] and scraped["rules"].get("thinking")
    names = {n for (n, _) in metric_values(api_server)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "chunkscope:chunks_total",
                 "chunkscope:mix_blocked_total", "chunkscope:telemetry_events_dropped_total"):
        assert name in names, name
