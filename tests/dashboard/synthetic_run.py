"""A small deterministic scheduler simulation that emits realistic telemetry event sequences.

Used by the dashboard tests (a few hundred ticks) and by ``bench/dashboard.py``
(scaled to a million events) until a fixture from a short real engine run
replaces it for the tests. It follows the engine's rules closely enough for
the dashboard: requests arrive, are admitted, prefilled in chunks capped by
``max_prefill_tokens`` (mixed into the decode batch when decodes are active
and the ``bisect_no_mix`` lever is off), decode one token per tick, get
preempted when KV blocks run out, and finish or fail. Stream record / wait
pairs mark the prefill -> default hand-off.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from telemetry import events as ev

BLOCK_SIZE = 16


@dataclass
class _Req:
    request_id: int
    arrival_ns: int
    arrival_tick: int
    prompt_len: int
    target_output: int
    prefix_hit_tokens: int
    miss_reason: str | None
    will_fail: bool
    admitted_ns: int | None = None
    first_token_ns: int | None = None
    prefilled: int = 0
    prefill_target: int = 0         # prompt plus any output already generated (recompute after preemption)
    is_prefilled: bool = False
    output: list[int] = field(default_factory=list)

    def record(self, tick: int, t_ns: int, status: str, **extra) -> ev.RequestRecord:
        return ev.RequestRecord(
            tick=tick, t_ns=t_ns, request_id=self.request_id, status=status, arrival_ns=self.arrival_ns,
            admitted_ns=self.admitted_ns, first_token_ns=self.first_token_ns, arrival_tick=self.arrival_tick,
            prompt_len=self.prompt_len, output_len=len(self.output), prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_miss_reason=self.miss_reason, sampling={"temperature": 0.7, "top_p": 0.9, "seed": self.request_id},
            **extra)

    def num_blocks(self) -> int:
        return -(-(self.prefilled + len(self.output)) // BLOCK_SIZE)


@dataclass(frozen=True)
class SimConfig:
    num_requests: int = 30
    mean_gap_ms: float = 6.0
    prompt_len: tuple[int, int] = (40, 400)
    output_len: tuple[int, int] = (8, 40)
    max_prefill_tokens: int = 128
    kv_blocks_total: int = 88
    ssm_slots_total: int = 8
    max_active: int = 8
    error_every: int = 13           # every Nth request fails during prefill
    bisect_on_tick: int = 80        # the dashboard flips bisect_no_mix here
    bisect_off_tick: int = 160
    seed: int = 0


def simulate(cfg: SimConfig = SimConfig()):
    """Yield telemetry events in the order an engine would emit them."""
    rng = random.Random(cfg.seed)
    pending: list[_Req] = []
    t = 0
    for i in range(cfg.num_requests):
        t += int(rng.expovariate(1.0 / cfg.mean_gap_ms) * 1e6)
        prompt = rng.randint(*cfg.prompt_len)
        hit = (prompt // 2 // BLOCK_SIZE) * BLOCK_SIZE if i % 4 == 3 else 0
        pending.append(_Req(i, t, 0, prompt, rng.randint(*cfg.output_len), hit,
                            None if hit else ("no_match" if i % 3 else "evicted"),
                            (i + 1) % cfg.error_every == 0))
    waiting: list[_Req] = []
    active: list[_Req] = []
    tick, now, seq, bisect = 0, 0, 0, False
    while pending or waiting or active:
        # Lever changes at tick boundaries, like the engine's lever watcher.
        if tick in (cfg.bisect_on_tick, cfg.bisect_off_tick):
            yield ev.LeverChange(tick=tick, t_ns=now, name="bisect_no_mix", old=bisect, new=not bisect,
                                 source="dashboard", status="applied", file_version=1 + (tick == cfg.bisect_off_tick))
            bisect = not bisect
        if tick == cfg.bisect_on_tick + 5:
            yield ev.LeverChange(tick=tick, t_ns=now, name="max_prefill_tokens", old=cfg.max_prefill_tokens,
                                 new=-5, source="dashboard", status="rejected",
                                 reason="max_prefill_tokens must be >= 1", file_version=2)
        while pending and pending[0].arrival_ns <= now:
            req = pending.pop(0)
            req.arrival_tick = tick
            waiting.append(req)
            yield ev.RequestEvent(tick=tick, t_ns=req.arrival_ns, request_id=req.request_id, kind="arrived")
            yield req.record(tick, req.arrival_ns, ev.REQ_WAITING)
        if not waiting and not active:
            now = pending[0].arrival_ns
            yield ev.Tick(tick=tick, t_ns=now, path=ev.PATH_IDLE, duration_ns=50_000, num_waiting=0,
                          kv_blocks_total=cfg.kv_blocks_total, ssm_slots_total=cfg.ssm_slots_total)
            tick += 1
            continue
        decoding = [r for r in active if r.is_prefilled]
        prefill = next((r for r in active if not r.is_prefilled), None)
        if prefill is None and waiting and len(active) < cfg.max_active:
            prefill = waiting.pop(0)
            prefill.admitted_ns = now
            prefill.prefill_target = prefill.prompt_len + len(prefill.output)
            active.append(prefill)
            yield ev.RequestEvent(tick=tick, t_ns=now, request_id=prefill.request_id, kind="admitted")
            yield ev.RequestEvent(tick=tick, t_ns=now, request_id=prefill.request_id, kind="prefill_start")
            yield prefill.record(tick, now, ev.REQ_PREFILLING)
        chunk_len, path = 0, ev.PATH_DECODE
        if prefill is not None:
            remaining = prefill.prefill_target - prefill.prefilled
            chunk_len = min(remaining, cfg.max_prefill_tokens)
            can_mix = bool(decoding) and not bisect
            blocker = None if can_mix else (ev.BLOCK_BISECT if bisect and decoding else ev.BLOCK_NO_DECODES)
            path = ev.PATH_MIXED if can_mix else ev.PATH_PREFILL
        # KV pressure: preempt the request holding the most blocks until the chunk fits.
        need = sum(r.num_blocks() for r in active) + (-(-chunk_len // BLOCK_SIZE)) + len(decoding) // 4
        while need > cfg.kv_blocks_total and len(active) > 1:
            victim = max((r for r in active if r is not prefill), key=lambda r: r.num_blocks())
            freed = victim.num_blocks()
            active.remove(victim)
            yield ev.Preemption(tick=tick, t_ns=now, victim_request_id=victim.request_id, blocks_freed=freed,
                                reason="kv_exhausted", prefill_request_id=prefill.request_id if prefill else None,
                                num_remaining=len(active))
            yield ev.RequestEvent(tick=tick, t_ns=now, request_id=victim.request_id, kind="preempted")
            victim.prefilled, victim.is_prefilled = 0, False  # recomputed from scratch when re-admitted
            yield victim.record(tick, now, ev.REQ_PREEMPTED)
            waiting.insert(0, victim)
            need -= freed
            decoding = [r for r in active if r.is_prefilled]
        if prefill is not None and path == ev.PATH_MIXED and not decoding:
            path, blocker, can_mix = ev.PATH_PREFILL, ev.BLOCK_NO_DECODES, False
        width = len(decoding) if path != ev.PATH_PREFILL else 0
        duration = int((0.4 + chunk_len * 0.004 + width * 0.05) * 1e6)
        if prefill is not None:
            is_last = prefill.prefilled + chunk_len >= prefill.prefill_target
            fails = prefill.will_fail and is_last
            yield ev.ChunkDecision(
                tick=tick, t_ns=now, request_id=prefill.request_id, offset=prefill.prefilled, length=chunk_len,
                prompt_len=prefill.prompt_len, is_last=is_last,
                cap_rule=ev.CAP_MAX_PREFILL if chunk_len == cfg.max_prefill_tokens else ev.CAP_REMAINING,
                max_prefill_tokens=cfg.max_prefill_tokens, path=path, can_mix=can_mix, mix_blocker=blocker,
                decode_width=width, duration_ns=duration, outcome="error" if fails else "ok")
            seq += 1
            yield ev.StreamEvent(tick=tick, t_ns=now + duration // 2, kind="record", stream="prefill",
                                 event_name="chunk_done", seq=seq)
            yield ev.StreamEvent(tick=tick, t_ns=now + duration // 2 + 20_000, kind="wait", stream="default",
                                 event_name="chunk_done", seq=seq, target_stream="default")
            prefill.prefilled += chunk_len
            if fails:
                active.remove(prefill)
                yield ev.RequestEvent(tick=tick, t_ns=now + duration, request_id=prefill.request_id, kind="error",
                                      detail="prompt exceeds the model's context length")
                yield prefill.record(tick, now + duration, ev.REQ_ERROR, finished_ns=now + duration,
                                     error="prompt exceeds the model's context length", finish_reason="error")
            elif is_last and prefill.first_token_ns is not None:
                prefill.is_prefilled = True     # resumed after preemption: no new first token
                yield prefill.record(tick, now + duration, ev.REQ_DECODING)
            elif is_last:
                prefill.is_prefilled = True
                prefill.first_token_ns = now + duration
                prefill.output.append(rng.randrange(1000))
                yield ev.RequestEvent(tick=tick, t_ns=now + duration, request_id=prefill.request_id,
                                      kind="first_token")
                yield ev.TokenEvent(tick=tick, t_ns=now + duration, request_id=prefill.request_id, index=0,
                                    token_id=prefill.output[-1])
                yield prefill.record(tick, now + duration, ev.REQ_DECODING)
        num_finished = 0
        for req in (decoding if path != ev.PATH_PREFILL else []):
            req.output.append(rng.randrange(1000))
            yield ev.TokenEvent(tick=tick, t_ns=now + duration, request_id=req.request_id,
                                index=len(req.output) - 1, token_id=req.output[-1])
            if len(req.output) >= req.target_output:
                active.remove(req)
                num_finished += 1
                yield ev.RequestEvent(tick=tick, t_ns=now + duration, request_id=req.request_id,
                                      kind="finished", detail="length")
                yield req.record(tick, now + duration, ev.REQ_FINISHED, finished_ns=now + duration,
                                 finish_reason="length")
        if tick % 25 == 0:
            yield ev.StreamEvent(tick=tick, t_ns=now + duration, kind="sync", stream="default", event_name="step",
                                 seq=0)
        yield ev.Tick(
            tick=tick, t_ns=now, path=path, duration_ns=duration,
            num_prefill_tokens=chunk_len, num_decode_tokens=width, num_active=len(decoding),
            num_waiting=len(waiting), num_prefilling=int(prefill is not None),
            kv_blocks_used=min(cfg.kv_blocks_total, sum(r.num_blocks() for r in active)),
            kv_blocks_total=cfg.kv_blocks_total, ssm_slots_used=len(active), ssm_slots_total=cfg.ssm_slots_total,
            num_finished=num_finished,
            # a roofline share of 20-80 % by tick (no rng draw: the other values stay as they were)
            roofline_ns=duration * (20 + (tick * 37) % 61) // 100)
        now += duration + 30_000
        tick += 1


def run_started(cfg: SimConfig, levers: dict | None = None) -> ev.RunStarted:
    return ev.RunStarted(
        started_at=1_700_000_000.0, model="tiny", device="cpu",
        config={"kv_blocks": cfg.kv_blocks_total, "block_size": BLOCK_SIZE, "ssm_slots": cfg.ssm_slots_total},
        model_config={"num_hidden_layers": 4}, versions={"python": "3.11"},
        workload={"kind": "synthetic", "num_requests": cfg.num_requests, "seed": cfg.seed},
        levers=levers or {"bisect_no_mix": False, "max_prefill_tokens": cfg.max_prefill_tokens})


def write_run(db_path, cfg: SimConfig = SimConfig(), status: str = "finished", progress=None) -> int:
    """Write one simulated run through the real telemetry writer; returns its run_id and event count."""
    from telemetry.writer import TelemetryWriter

    writer = TelemetryWriter(db_path, queue_size=200_000, max_batch=20_000)
    run_id = writer.start_run(run_started(cfg))
    num_events = 0
    for event in simulate(cfg):
        writer.emit(event)
        num_events += 1
        if progress is not None and num_events % 10_000 == 0:
            progress(10_000)
    writer.close(status)
    return run_id
