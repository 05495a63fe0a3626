"""vLLM's metric families as vLLM v1 declares them: names, types, labels (``model_name``,
``engine``) and buckets, so dashboards built for vLLM read this engine unchanged.

Two deprecated names vLLM still exports on request (``--show-hidden-metrics-for-version``) and
its example Grafana dashboard still charts are exported too, with the same values as their
successors: ``vllm:gpu_cache_usage_perc`` (= ``kv_cache_usage_perc``) and
``vllm:time_per_output_token_seconds`` (= ``inter_token_latency_seconds``). Families that
describe hardware or features this engine does not have (LoRA, sleep mode, KV connectors,
multimodal caches) are left out rather than exported as constants.
"""
from __future__ import annotations

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"          # one engine core per process (vLLM's data-parallel index)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, to max_model_len)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


# name (as declared; counters get _total when exposed) -> help
GAUGES = {
    "vllm:num_requests_running": "Requests prefilling or decoding.",
    "vllm:num_requests_waiting": "Requests waiting for admission.",
    "vllm:kv_cache_usage_perc": "Share of the KV cache blocks in use (1 = full).",
    "vllm:gpu_cache_usage_perc": "Deprecated name of vllm:kv_cache_usage_perc (same value).",
}
COUNTERS = {
    "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "vllm:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "vllm:num_preemptions": "Requests preempted to free KV cache blocks.",
    "vllm:prompt_tokens": "Prompt tokens of requests that reached their first token.",
    "vllm:spec_decode_num_drafts": "Speculative steps that proposed drafts.",
    "vllm:spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "vllm:spec_decode_num_accepted_tokens": "Draft tokens the verification accepted.",
}
REQUEST_SUCCESS = ("vllm:request_success", "Requests ended, by finish reason (stop, length, abort).")
ACCEPTED_PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens, by their position in the draft.")
CACHE_CONFIG_INFO = ("vllm:cache_config_info", "The KV cache configuration, as labels (value 1).")


def histograms(max_model_len: int) -> dict[str, tuple[str, tuple]]:
    """name -> (help, buckets) of vLLM's request and iteration histograms."""
    lengths = buckets_1_2_5(max_model_len)
    latency = REQUEST_LATENCY_BUCKETS
    return {
        "vllm:request_prompt_tokens": ("Prompt length of each finished request.", lengths),
        "vllm:request_generation_tokens": ("Output length of each finished request.", lengths),
        "vllm:iteration_tokens_total": ("Tokens computed by each tick's forward.", ITERATION_TOKENS_BUCKETS),
        "vllm:request_max_num_generation_tokens": ("Longest output among a request's n choices.", lengths),
        "vllm:request_params_n": ("The n of each API request (choices per prompt).", N_BUCKETS),
        "vllm:request_params_max_tokens": ("The max_tokens of each finished request.", lengths),
        "vllm:time_to_first_token_seconds": ("Arrival to first token, seconds.", TTFT_BUCKETS),
        "vllm:request_time_per_output_token_seconds": ("Mean time between output tokens of each finished request, seconds.",
                                                       TOKEN_LATENCY_BUCKETS),
        "vllm:e2e_request_latency_seconds": ("Arrival to end of each finished request, seconds.", latency),
        "vllm:request_queue_time_seconds": ("Arrival to admission, seconds.", latency),
        "vllm:request_inference_time_seconds": ("Admission to last token, seconds.", latency),
        "vllm:request_prefill_time_seconds": ("Admission to first token, seconds.", latency),
        "vllm:request_decode_time_seconds": ("First token to last token, seconds.", latency),
    }


# Per-token families, counted in plain numbers on the engine thread (metrics.py says why).
GENERATION_TOKENS = ("vllm:generation_tokens", "Output tokens generated.")
TOKEN_LATENCY = {
    "vllm:inter_token_latency_seconds": "Time between two tokens of a request, seconds.",
    "vllm:time_per_output_token_seconds": "Deprecated name of vllm:inter_token_latency_seconds (same observations).",
}
