"""``summary.md`` of a bundle: what a reader of a bug report wants first.

The run in numbers (``TelemetryReader.run_summary``, the CLI's contract), the
errors grouped by message, the lever changes, and the top preemptions. Built
from the bundle's own snapshot, so it agrees with every other file in it.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from telemetry.reader import TelemetryReader
from telemetry.ro_uri import read_only_uri
from telemetry.schema import json_value

TOP_PREEMPTIONS = 10


def _cell(value: Any) -> str:
    if isinstance(value, float):
        value = round(value, 3)
    text = json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


_ERRORS_SQL = """
SELECT 'request' AS source, coalesce(error, '(no message)') AS message, count(*) AS n,
       group_concat(request_id) AS ids, min(t_ns) AS first_ns
FROM requests WHERE status IN ('error', 'preempted', 'rejected') GROUP BY message
UNION ALL
SELECT 'chunk', 'chunk outcome ' || outcome, count(*), group_concat(request_id), min(t_ns)
FROM chunks WHERE outcome LIKE 'failed%' GROUP BY outcome
UNION ALL
SELECT 'event', kind || coalesce(': ' || json_extract(detail, '$.message'), ''), count(*),
       group_concat(request_id), min(t_ns)
FROM events WHERE kind LIKE '%error%' OR kind LIKE '%fail%' GROUP BY 2
ORDER BY n DESC, first_ns
"""


def build_summary_md(db_path: str | Path, run_id: int, manifest: dict[str, Any]) -> str:
    """Markdown text for one run of a snapshot database."""
    summary = TelemetryReader(db_path).run_summary(run_id) or {}
    conn = sqlite3.connect(read_only_uri(Path(db_path)), uri=True)
    conn.row_factory = sqlite3.Row
    try:
        errors = [dict(r) for r in conn.execute(_ERRORS_SQL)]
        levers = [dict(r) for r in conn.execute("SELECT * FROM lever_changes ORDER BY tick, id")]
        sources = [dict(r) for r in conn.execute(
            "SELECT coalesce(source, 'workload') AS source, status, count(*) AS n FROM requests "
            "GROUP BY 1, 2 ORDER BY 1, 2")]
        top = [dict(r) for r in conn.execute(
            "SELECT * FROM preemptions ORDER BY blocks_freed DESC, tick, id LIMIT ?", [TOP_PREEMPTIONS])]
        most_preempted = [dict(r) for r in conn.execute(
            "SELECT victim_request_id, count(*) AS n, sum(blocks_freed) AS blocks FROM preemptions "
            "GROUP BY victim_request_id ORDER BY n DESC, blocks DESC, victim_request_id LIMIT ?", [TOP_PREEMPTIONS])]
    finally:
        conn.close()
    time_range = manifest.get("time_range", {})
    lines = [f"# Chunkscope run {run_id}", "",
             f"Model `{manifest.get('run', {}).get('model')}` on `{manifest.get('device')}`, "
             f"status `{summary.get('status')}`, command `{manifest.get('command_line')}`.", ""]
    if time_range.get("is_windowed"):
        lines += [f"Time window: {time_range.get('since_ns')} .. {time_range.get('until_ns')} ns "
                  "(run-relative); counts below cover the window only.", ""]
    lines += ["## The run in numbers", ""] + _table(["metric", "value"], [[k, v] for k, v in summary.items()])
    lines += ["", "## Requests by source (api = HTTP clients, workload = the engine's own)", ""]
    lines += _table(["source", "status", "requests"], [[r["source"], r["status"], r["n"]] for r in sources]) \
        if sources else ["No requests."]
    lines += ["", f"## Errors ({sum(e['n'] for e in errors)})", ""]
    lines += _table(["source", "message", "count", "request ids", "first at (ms)"],
                    [[e["source"], e["message"], e["n"], _ids(e["ids"]), (e["first_ns"] or 0) / 1e6]
                     for e in errors]) if errors else ["No errors."]
    lines += ["", f"## Lever changes ({len(levers)})", ""]
    lines += ["Start values: " + ", ".join(f"`{k}={_cell(v)}`" for k, v in
                                          manifest.get("levers", {}).get("start", {}).items()), ""]
    lines += _table(["tick", "lever", "old", "new", "source", "status", "reason"],
                    [[c["tick"], c["name"], json_value(c["old"]), json_value(c["new"]), c["source"], c["status"], c["reason"]]
                     for c in levers]) if levers else ["No lever changes."]
    lines += ["", f"## Top preemptions ({summary.get('preemptions', 0)} in all)", ""]
    if top:
        lines += _table(["tick", "victim", "blocks freed", "reason", "policy", "for request", "remaining"],
                        [[p["tick"], p["victim_request_id"], p["blocks_freed"], p["reason"], p["policy"],
                          p["prefill_request_id"], p["num_remaining"]] for p in top])
        lines += ["", "Most preempted requests:", ""]
        lines += _table(["request", "times", "blocks freed"],
                        [[m["victim_request_id"], m["n"], m["blocks"]] for m in most_preempted])
    else:
        lines += ["No preemptions."]
    return "\n".join(lines) + "\n"


def _ids(text: str | None, limit: int = 12) -> str:
    ids = [i for i in (text or "").split(",") if i]
    return ", ".join(ids[:limit]) + (f" (+{len(ids) - limit})" if len(ids) > limit else "")
