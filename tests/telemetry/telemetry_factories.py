"""Builders shared by the telemetry tests: a run header and one event of every kind."""
from __future__ import annotations

import time

from telemetry import events as ev


def make_run_started(**overrides) -> ev.RunStarted:
    fields = dict(started_at=time.time(), model="tiny", device="cpu",
                  config={"num_kv_blocks": 64, "block_size": 16},
                  model_config={"hidden_size": 64, "layer_types": ["linear_attention", "full_attention"]},
                  versions={"python": "3.11"}, workload={"kind": "synthetic", "rate": 4.0, "seed": 7},
                  levers={"bisect_no_mix": False, "max_prefill_tokens": 256}, command_line="python -m engine")
    fields.update(overrides)
    return ev.RunStarted(**fields)


def one_of_each() -> list:
    """A non-default instance of every event class (bools, None, JSON fields, floats)."""
    return [
        ev.Tick(tick=1, t_ns=1_000, path=ev.PATH_MIXED, duration_ns=900, num_prefill_tokens=48,
                num_decode_tokens=3, num_active=3, num_waiting=2, num_prefilling=1, kv_blocks_used=10,
                kv_blocks_total=64, ssm_slots_used=4, ssm_slots_total=8, num_finished=1),
        ev.ChunkDecision(tick=1, t_ns=1_100, request_id=7, offset=16, length=48, prompt_len=100,
                         is_last=False, cap_rule=ev.CAP_SSM_TAIL, max_prefill_tokens=256, slice_budget=None,
                         ssm_tail_boundary=64, path=ev.PATH_MIXED, can_mix=True, mix_blocker=None,
                         decode_width=3, duration_ns=800, outcome="ok", num_preempted=0),
        ev.StreamEvent(tick=1, t_ns=1_200, kind="wait", stream="prefill", event_name="prefill_done",
                       seq=5, target_stream="default", gpu_elapsed_ms=0.25),
        ev.Preemption(tick=2, t_ns=2_000, victim_request_id=3, blocks_freed=6, reason="kv exhausted",
                      policy="newest", prefill_request_id=7, num_remaining=2),
        ev.RequestRecord(tick=2, t_ns=2_100, request_id=7, status=ev.REQ_DECODING, arrival_ns=100,
                         admitted_ns=200, first_token_ns=1_900, finished_ns=None, arrival_tick=0,
                         prompt_len=100, output_len=2, prefix_hit_tokens=32, prefix_miss_reason=None,
                         error=None, finish_reason=None,
                         sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 1},
                         prompt_tokens=[1, 2, 3], output_tokens=[9, 10], conversation_id=4),
        ev.RequestEvent(tick=2, t_ns=2_200, request_id=7, kind="first_token", detail="token 9"),
        ev.TokenEvent(tick=2, t_ns=2_300, request_id=7, index=1, token_id=10),
        ev.LeverChange(tick=3, t_ns=3_000, name="max_prefill_tokens", old=256, new=128, source="dashboard",
                       status="applied", reason=None, file_version=4),
        ev.GenericEvent(tick=3, t_ns=3_100, kind="drafts_dropped", request_id=None,
                        detail={"num_drafts": 3, "nested": {"ok": True}}),
    ]
