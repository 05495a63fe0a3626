"""A small two-run telemetry store with every feature a bundle must carry.

Run 1 is noise (another run's rows must not leak into run 2's bundle). Run 2
has overlapping chunk slices (clamped in the trace), a record/wait pair and an
orphan wait, preemptions, applied and rejected lever changes, errors, a
request still open, and absolute paths inside and outside the run directory.
"""
from __future__ import annotations

from pathlib import Path

from telemetry import events as ev
from telemetry.writer import TelemetryWriter
from telemetry_factories import make_run_started

MS = 1_000_000
NUM_TICKS = 40
OUTSIDE_PATH = "/home/secret-user/checkpoints/qwen-small"


def build_store(run_dir: Path) -> Path:
    db_path = run_dir / "telemetry.db"
    with TelemetryWriter(db_path) as writer:
        writer.start_run(make_run_started())
        writer.emit(ev.Tick(tick=0, t_ns=0, path=ev.PATH_DECODE, duration_ns=MS))
        writer.emit(ev.RequestRecord(tick=0, t_ns=0, request_id=99, arrival_ns=0, arrival_tick=0,
                                     prompt_tokens=[5], sampling={"max_tokens": 1, "seed": 1}))
    with TelemetryWriter(db_path) as writer:
        writer.start_run(make_run_started(
            command_line=f"python -m engine serve --model {OUTSIDE_PATH} --run-dir {run_dir} "
                         f"--workload trace:{run_dir}/traces/azure.csv",
            workload={"kind": "trace", "path": f"{run_dir}/traces/azure.csv", "other": OUTSIDE_PATH}))
        _emit_run(writer)
    return db_path


def _emit_run(writer: TelemetryWriter) -> None:
    for tick in range(NUM_TICKS):
        t = tick * 10 * MS
        path = ev.PATH_MIXED if tick % 4 == 0 else ev.PATH_DECODE
        # Tick 5 runs 3 ms past the next tick's start: the trace must clamp it.
        writer.emit(ev.Tick(tick=tick, t_ns=t, path=path, duration_ns=(13 if tick == 5 else 8) * MS,
                            num_prefill_tokens=32 if path == ev.PATH_MIXED else 0, num_decode_tokens=2,
                            num_active=2, num_waiting=tick % 3, num_prefilling=1, kv_blocks_used=10 + tick,
                            kv_blocks_total=64))
        if path == ev.PATH_MIXED:
            # Chunk forwards overlap the next chunk when tick % 8 == 0 (12 ms > 40 ms gap? no: 45 ms).
            writer.emit(ev.ChunkDecision(tick=tick, t_ns=t + MS, request_id=tick // 4, length=32,
                                         prompt_len=64, path=path, can_mix=True, decode_width=2,
                                         duration_ns=(45 if tick % 8 == 0 else 6) * MS))
            writer.emit(ev.StreamEvent(tick=tick, t_ns=t + 7 * MS, kind="record", stream="prefill",
                                       event_name="prefill_done", seq=tick))
            writer.emit(ev.StreamEvent(tick=tick, t_ns=t + 7 * MS + 5_000, kind="wait", stream="prefill",
                                       event_name="prefill_done", seq=tick, target_stream="default"))
        writer.emit(ev.TokenEvent(tick=tick, t_ns=t + 8 * MS, request_id=tick // 4, index=tick % 4, token_id=tick))
    # A wait whose record is not in the store: no dangling flow may come of it.
    writer.emit(ev.StreamEvent(tick=3, t_ns=33 * MS, kind="wait", stream="prefill", event_name="prefill_done",
                               seq=1000, target_stream="default"))
    writer.emit(ev.StreamEvent(tick=9, t_ns=95 * MS, kind="sync", stream="default", event_name="sync", seq=2000))
    for rid in range(10):
        arrival = rid * 40 * MS
        is_open, is_error = rid == 9, rid in (3, 6)
        writer.emit(ev.RequestRecord(
            tick=rid * 4, t_ns=arrival + 30 * MS, request_id=rid, arrival_tick=rid * 4, arrival_ns=arrival,
            admitted_ns=arrival + 2 * MS, first_token_ns=arrival + 9 * MS,
            finished_ns=None if is_open else arrival + 30 * MS,
            status=ev.REQ_ERROR if is_error else (ev.REQ_DECODING if is_open else ev.REQ_FINISHED),
            error="KV cache exhausted" if is_error else None, prompt_len=64, output_len=4,
            prompt_tokens=list(range(rid, rid + 64)), output_tokens=[1, 2, 3, 4],
            sampling={"temperature": 0.0, "max_tokens": 4, "seed": 100 + rid}, conversation_id=None))
    writer.emit(ev.Preemption(tick=12, t_ns=121 * MS, victim_request_id=2, blocks_freed=6, reason="kv exhausted",
                              prefill_request_id=3, num_remaining=1))
    writer.emit(ev.Preemption(tick=30, t_ns=301 * MS, victim_request_id=2, blocks_freed=9, reason="kv exhausted",
                              prefill_request_id=7, num_remaining=0))
    writer.emit(ev.LeverChange(tick=10, t_ns=100 * MS, name="max_prefill_tokens", old=256, new=128, source="file",
                               file_version=1))
    writer.emit(ev.LeverChange(tick=20, t_ns=200 * MS, name="bisect_no_mix", old=False, new=True,
                               source="dashboard", file_version=2))
    writer.emit(ev.LeverChange(tick=25, t_ns=250 * MS, name="slice_budget", old=64, new=-1, source="file",
                               status="rejected", reason="slice_budget must be >= 1", file_version=3))
    writer.emit(ev.GenericEvent(tick=26, t_ns=260 * MS, kind="ssm_normalize_failed", request_id=4,
                                detail={"message": "non-finite state"}))
