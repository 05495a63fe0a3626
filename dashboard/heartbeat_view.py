"""The engine's state now, from its heartbeat file, for the Live page when ticks stop.

Ticks stop when the engine is blocked (the queue head cannot start) or idle;
the last tick row then shows numbers from the past. The heartbeat
(``engine_status.json``, rewritten every second and at once when a stall
starts) says what the engine holds now and what blocks the queue head.
``live_state`` is a pure decision; the Live page draws what it returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

FRESH_S = 3.0      # a heartbeat younger than this describes the engine now
TICKS_STOPPED_S = 1.5
OPEN_STALL_STEP_MS = 2_000.0


@dataclass(frozen=True)
class LiveState:
    counters: dict[str, Any]      # waiting, active, prefilling, KV / SSM use, tick: the engine now
    blocker: str | None           # what keeps the queue head waiting
    is_blocked: bool              # nothing can run until the blocker goes
    age_s: float                  # heartbeat age
    run_ms: float | None = None   # the run's clock now (ms since run start), when the heartbeat says it


def live_state(status: dict[str, Any] | None, run_id: int, is_alive: bool, last_tick_age_s: float | None,
               *, now: float | None = None) -> LiveState | None:
    """The heartbeat's picture when it is fresh, from this run's live engine, and worth showing:
    the engine is blocked or its ticks stopped. None otherwise (the tick rows are current)."""
    if not status or not is_alive or status.get("state") != "serving" or status.get("run_id") != run_id:
        return None
    age = (time.time() if now is None else now) - float(status.get("updated_at") or 0.0)
    if age > FRESH_S:
        return None
    is_blocked = bool(status.get("is_blocked"))
    ticks_stopped = last_tick_age_s is None or last_tick_age_s > TICKS_STOPPED_S
    if not (is_blocked or ticks_stopped):
        return None
    counters = {
        "num_waiting": status.get("num_waiting", 0), "num_active": status.get("num_active", 0),
        "num_prefilling": status.get("num_prefilling", 0),
        "kv_blocks_used": status.get("kv_blocks_used", 0), "kv_blocks_total": status.get("kv_blocks_usable", 0),
        "ssm_slots_used": status.get("ssm_slots_used", 0), "ssm_slots_total": status.get("ssm_slots_total", 0),
        "tick": status.get("tick", 0),
    }
    run_t_ns = status.get("run_t_ns")
    run_ms = float(run_t_ns) / 1e6 + max(0.0, age) * 1e3 if isinstance(run_t_ns, (int, float)) else None
    return LiveState(counters, status.get("blocker"), is_blocked, max(0.0, age), run_ms)


def open_stall_end_ms(state: LiveState | None, step_ms: float = OPEN_STALL_STEP_MS) -> float | None:
    """Where the Live timeline ends a stall still open: now, in ``step_ms`` steps (the timeline is
    rebuilt once per step while blocked, not every second); None when not blocked."""
    if state is None or not state.is_blocked or state.run_ms is None:
        return None
    return state.run_ms // step_ms * step_ms


def describe(state: LiveState) -> str:
    """One line for the page: blocked and why, or idle."""
    c = state.counters
    held = (f"{c['num_waiting']} waiting, {c['num_active']} decoding, KV {c['kv_blocks_used']} / "
            f"{c['kv_blocks_total']} blocks; heartbeat {state.age_s:.1f} s ago")
    if state.is_blocked:
        return f"Engine blocked at tick {c['tick']}: {state.blocker}. ({held})"
    if state.blocker:
        return f"No tick for a while at tick {c['tick']}; the queue head waits: {state.blocker}. ({held})"
    return f"Engine idle at tick {c['tick']}: no request to run. ({held})"
