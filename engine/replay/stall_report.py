"""The replay report's stall section: lever changes, blocked time and TTFT p99, recorded vs replayed.

A replay steps by tick, and a blocked engine's ticks stand still, so the wall time a recording
spent blocked (a KV cap no request fits under, lifted 65 s later by hand) cannot come back in the
replay; "decisions: identical" alone then hid a 59 s TTFT p99. This section says what the
recording went through (its blocked spells, from the ``stalled`` / ``stall_cleared`` events, and
its TTFT p99) beside what the replay met (where no step was possible after a lever apply, and its
own TTFT p99 on its own clock), and that every recorded lever change was applied again.
"""
from __future__ import annotations

import math
from typing import Any

from telemetry.stalls import Spell

MAX_LISTED = 5          # spells named in the text report (the JSON has all)


def p99_ms(values_ms: list[float]) -> float | None:
    """Nearest-rank p99 (None without values)."""
    if not values_ms:
        return None
    ordered = sorted(values_ms)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def ttft_ms(requests: list[Any]) -> list[float]:
    """First-token latencies of requests with ``arrival_ns`` / ``first_token_ns`` (recorded rows or
    the replay's Request objects)."""
    return [(r.first_token_ns - r.arrival_ns) / 1e6 for r in requests
            if getattr(r, "first_token_ns", None) is not None and getattr(r, "arrival_ns", None) is not None]


def stall_section(spells: list[Spell], num_recorded_changes: int, lever_log: list[dict],
                  blocked_log: list[dict], recorded_ttft_ms: list[float], replayed_ttft_ms: list[float]) -> dict:
    """The report's ``stall`` object (JSON-ready)."""
    return {
        "lever_changes": {"recorded": num_recorded_changes,
                          "replayed": sum(len(entry["changes"]) for entry in lever_log),
                          "applies_replayed": len(lever_log)},
        "blocked_s": {"recorded": round(sum(s.seconds for s in spells), 3),
                      "replayed": None},        # wall time: a replay steps by tick (see the module doc)
        "spells_recorded": [{"start_s": s.start_ns / 1e9, "seconds": round(s.seconds, 3), "blocker": s.blocker,
                             "is_open": s.is_open} for s in spells],
        "blocked_replayed": blocked_log,
        "ttft_p99_ms": {"recorded": p99_ms(recorded_ttft_ms), "replayed": p99_ms(replayed_ttft_ms)},
    }


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.1f} ms"


def stall_lines(section: dict) -> list[str]:
    """The section for a person: three lines, more when the recording was blocked."""
    levers, ttft = section["lever_changes"], section["ttft_p99_ms"]
    spells, replayed = section["spells_recorded"], section["blocked_replayed"]
    lines = [f"lever changes: {levers['recorded']} recorded, {levers['replayed']} replayed "
             f"({levers['applies_replayed']} applies)"]
    if spells:
        lines.append(f"blocked: {section['blocked_s']['recorded']:.1f} s recorded in {len(spells)} spell(s); "
                     f"the replay steps by tick, so that wall time is not replayed")
        lines += [f"  recorded at {s['start_s']:.1f} s: blocked {s['seconds']:.1f} s"
                  f"{' (never cleared)' if s['is_open'] else ''}: {s['blocker']}" for s in spells[:MAX_LISTED]]
        lines += [f"  replayed at tick {b['tick']}: no step possible: {b['blocker']}" for b in replayed[:MAX_LISTED]]
        if not replayed:
            lines.append("  replayed: never blocked (the stall did not recur)")
    else:
        lines.append("blocked: never in the recording" + (f"; the replay was, at tick {replayed[0]['tick']}: "
                                                          f"{replayed[0]['blocker']}" if replayed else ""))
    lines.append(f"TTFT p99: {_ms(ttft['recorded'])} recorded, {_ms(ttft['replayed'])} replayed "
                 f"(each on its own clock)")
    return lines
