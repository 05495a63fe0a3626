"""Compare a replay with its recording: decisions, tokens, statuses, and the first divergence.

Pure data in, plain dicts out (the ``--json`` contract)::

    {"decisions_identical": bool, "tokens_identical": bool,
     "first_divergence": null | {"tick", "request_id", "field", "recorded", "replayed"},
     "requests": [{"request_id", "tokens_identical", "first_token_diff", "recorded_len",
                   "replayed_len", "status_recorded", "status_replayed"}, ...]}

Decisions are the chunk rows (which request, where, how long, which cap,
which path, the can-mix verdict) and the per-tick path and token counts,
both walked in tick order; the first row where any field differs is the
divergence. Tokens are compared per request; the earliest differing token
(by the tick it was generated at) is a divergence too, and the report's
``first_divergence`` is the earliest of all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.replay.record import RecordedRun, is_cut_short
from engine.replay.stall_report import stall_lines
from telemetry import events as ev

CHUNK_FIELDS = ("tick", "request_id", "offset", "length", "cap_rule", "path", "can_mix",
                "mix_blocker", "decode_width", "is_last")
TICK_FIELDS = ("tick", "path", "num_prefill_tokens", "num_decode_tokens", "num_constrained_rows")


@dataclass
class ReplayedRequest:
    request_id: int
    status: str
    error: str | None
    output_tokens: list[int]


@dataclass
class ReplayedRun:
    """What the replayed engine produced, in the recording's terms."""

    chunks: list[ev.ChunkDecision]
    ticks: list[ev.Tick]
    tokens: list[ev.TokenEvent]
    requests: dict[int, ReplayedRequest]
    lever_log: list[dict[str, Any]]           # {"tick", "changes"} applied during the replay
    blocked: list[dict[str, Any]] = field(default_factory=list)   # {"tick", "blocker"}: no step possible after an apply
    ttft_ms: list[float] = field(default_factory=list)               # the replay's own first-token latencies
    dtype: str = "float32"                    # what the replay computed in (``run_dtype.replay_dtype``)
    device: str = "cpu"
    model: Any = None                         # the loaded model (``divergence.explain`` reruns a position)


def first_row_difference(recorded: list[Any], replayed: list[Any], fields: tuple[str, ...],
                         what: str) -> dict[str, Any] | None:
    """The first row (in order) where a field differs, or where one side runs out."""
    for old, new in zip(recorded, replayed):
        for name in fields:
            if getattr(old, name) != getattr(new, name):
                return {"tick": min(old.tick, new.tick), "request_id": getattr(old, "request_id", None),
                        "field": f"{what}.{name}", "recorded": getattr(old, name),
                        "replayed": getattr(new, name)}
    if len(recorded) == len(replayed):
        return None
    longer, side = (recorded, "recorded") if len(recorded) > len(replayed) else (replayed, "replayed")
    extra = longer[min(len(recorded), len(replayed))]
    row = {name: getattr(extra, name) for name in fields}
    return {"tick": extra.tick, "request_id": getattr(extra, "request_id", None), "field": what,
            "recorded": row if side == "recorded" else None, "replayed": row if side == "replayed" else None}


def first_token_diff(recorded: list[int], replayed: list[int]) -> int | None:
    """Index of the first differing token; the shorter length when one is a prefix of the other."""
    for index, (a, b) in enumerate(zip(recorded, replayed)):
        if a != b:
            return index
    return None if len(recorded) == len(replayed) else min(len(recorded), len(replayed))


def _token_ticks(tokens: list[ev.TokenEvent]) -> dict[tuple[int, int], int]:
    return {(t.request_id, t.index): t.tick for t in tokens}


def compare(recorded: RecordedRun, replayed: ReplayedRun) -> dict[str, Any]:
    """The ``--json`` report (see the module docstring)."""
    chunk_diff = first_row_difference(recorded.chunks, replayed.chunks, CHUNK_FIELDS, "chunk")
    tick_diff = first_row_difference(recorded.ticks, replayed.ticks, TICK_FIELDS, "tick")
    recorded_tokens = recorded.output_tokens()
    recorded_tick_of = _token_ticks(recorded.tokens)
    replayed_tick_of = _token_ticks(replayed.tokens)
    divergences = [d for d in (chunk_diff, tick_diff) if d is not None]
    rows = []
    for record in recorded.requests:
        rid = record.request_id
        mine = recorded_tokens.get(rid, [])
        other = replayed.requests.get(rid)
        theirs = other.output_tokens if other else []
        cut = is_cut_short(record.status, record.error)
        # A request the recording cut short (crash, SIGTERM) only has a prefix to compare.
        compared = theirs[:len(mine)] if cut else theirs
        diff = first_token_diff(mine, compared)
        if diff is not None:
            tick = recorded_tick_of.get((rid, diff), replayed_tick_of.get((rid, diff), record.tick))
            divergences.append({"tick": tick, "request_id": rid, "field": f"output_tokens[{diff}]",
                                "recorded": mine[diff] if diff < len(mine) else None,
                                "replayed": compared[diff] if diff < len(compared) else None})
        status_same = other is not None and (
            (cut and is_cut_short(other.status, other.error))
            or (record.status == other.status and record.error == other.error))
        if not status_same and diff is None:
            divergences.append({"tick": record.tick, "request_id": rid, "field": "status",
                                "recorded": [record.status, record.error],
                                "replayed": [other.status, other.error] if other else None})
        rows.append({"request_id": rid, "tokens_identical": diff is None, "first_token_diff": diff,
                     "recorded_len": len(mine), "replayed_len": len(theirs),
                     "status_recorded": record.status, "status_replayed": other.status if other else None,
                     "error_recorded": record.error, "error_replayed": other.error if other else None,
                     "status_identical": status_same, "recorded_cut_short": cut})
    known = {r.request_id for r in recorded.requests}
    for rid in sorted(set(replayed.requests) - known):
        other = replayed.requests[rid]
        rows.append({"request_id": rid, "tokens_identical": False, "first_token_diff": 0,
                     "recorded_len": 0, "replayed_len": len(other.output_tokens),
                     "status_recorded": None, "status_replayed": other.status,
                     "error_recorded": None, "error_replayed": other.error,
                     "status_identical": False, "recorded_cut_short": False})
    first = min(divergences, key=lambda d: d["tick"]) if divergences else None
    return {
        "decisions_identical": chunk_diff is None and tick_diff is None,
        "tokens_identical": all(r["tokens_identical"] for r in rows),
        "statuses_identical": all(r["status_identical"] for r in rows),
        "first_divergence": first,
        "num_chunks": {"recorded": len(recorded.chunks), "replayed": len(replayed.chunks)},
        "num_ticks": {"recorded": len(recorded.ticks), "replayed": len(replayed.ticks)},
        "requests": rows,
    }


def text_report(report: dict[str, Any], *, flips: dict[str, Any], notes: list[str]) -> str:
    """The same findings for a person: verdicts first, then what differs and where."""
    def verdict(ok: bool) -> str:
        return "identical" if ok else "DIFFERENT"

    lines = []
    if flips:
        lines.append("flipped for the whole replay: " + ", ".join(f"{k}={v}" for k, v in flips.items()))
    for entry in report.get("lever_changes_replayed") or []:
        lines.append(f"levers applied at tick {entry['tick']}: "
                     + ", ".join(f"{k}={v}" for k, v in entry["changes"].items()))
    if report.get("stall"):
        lines += report["stall"].get("lines") or stall_lines(report["stall"])
    lines.append(f"decisions: {verdict(report['decisions_identical'])} "
                 f"({report['num_chunks']['recorded']} chunks recorded, {report['num_chunks']['replayed']} "
                 f"replayed; {report['num_ticks']['recorded']} ticks recorded, "
                 f"{report['num_ticks']['replayed']} replayed)")
    rows = report["requests"]
    num_same = sum(r["tokens_identical"] for r in rows)
    lines.append(f"tokens:    {verdict(report['tokens_identical'])} ({num_same} of {len(rows)} requests identical)")
    lines.append(f"statuses:  {verdict(report['statuses_identical'])}")
    first = report["first_divergence"]
    if first is None:
        lines.append("first divergence: none")
    else:
        lines.append(f"first divergence: tick {first['tick']}, request {first['request_id']}, "
                     f"{first['field']}: recorded {first['recorded']!r}, replayed {first['replayed']!r}")
    differing = [r for r in rows if not r["tokens_identical"] or not r["status_identical"]]
    if differing:
        lines.append("requests that differ:")
        for r in differing:
            where = "tokens same" if r["first_token_diff"] is None else f"first different token at {r['first_token_diff']}"
            lines.append(f"  request {r['request_id']}: {where} (lengths {r['recorded_len']} recorded, "
                         f"{r['replayed_len']} replayed; status {r['status_recorded']} -> {r['status_replayed']})")
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)
