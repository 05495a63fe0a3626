"""Read-only query layer over the telemetry store (the dashboard's and the CLI's view).

Every public call opens its own ``mode=ro`` URI connection and closes it, so
transactions stay short, threads never share a connection, and a database
that appears later is picked up. A missing or empty database (or one whose
schema the writer has not created yet) is "no telemetry yet": helpers return
empty lists / None. A locked, corrupt or non-SQLite file raises
``TelemetryUnavailable`` with one clear message. All aggregation runs in SQL
with bound parameters; percentiles use the nearest-rank method via window
functions, so big tables never travel into Python.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from typing import Any, Iterator

from telemetry import events as ev
from telemetry import schema
from telemetry.ro_uri import read_only_uri

TAILABLE_TABLES = tuple(t for t in ev.TABLES if t not in ("runs", schema.REQUESTS_TABLE))
_JSON_COLUMNS = {cls.TABLE: {n for n, h in schema.field_hints(cls).items() if schema.is_json_field(h)}
                 for cls in (ev.RunStarted, *ev.EVENT_TYPES)}


class TelemetryUnavailable(RuntimeError):
    """The store exists but cannot be read right now (locked, corrupt, not a database)."""


class _NoTelemetryYet(Exception):
    pass


class TelemetryReader:
    def __init__(self, db_path: str | os.PathLike, *, busy_timeout_ms: int = 2000) -> None:
        self.db_path = os.fspath(db_path)
        self._busy_timeout_ms = busy_timeout_ms

    # ---- connection ------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        if not os.path.exists(self.db_path) or os.path.getsize(self.db_path) == 0:
            raise _NoTelemetryYet
        try:
            uri = read_only_uri(self.db_path)
            conn = sqlite3.connect(uri, uri=True, timeout=self._busy_timeout_ms / 1000,
                                   isolation_level=None, check_same_thread=False)
        except (sqlite3.Error, OSError) as exc:
            raise TelemetryUnavailable(f"cannot open telemetry store {self.db_path}: {exc}") from None
        conn.row_factory = sqlite3.Row
        try:
            yield conn
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                raise _NoTelemetryYet from None
            raise TelemetryUnavailable(f"telemetry store {self.db_path} unavailable: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise TelemetryUnavailable(f"telemetry store {self.db_path} unreadable: {exc}") from None
        finally:
            conn.close()

    def _rows(self, sql: str, params: list | tuple = (), *, decode: str | None = None) -> list[dict[str, Any]]:
        try:
            with self._connect() as conn:
                rows = [dict(r) for r in conn.execute(sql, params)]
        except _NoTelemetryYet:
            return []
        return [_decode_json(decode, r) for r in rows] if decode else rows

    def _one(self, sql: str, params: list | tuple = ()) -> dict[str, Any] | None:
        rows = self._rows(sql, params)
        return rows[0] if rows else None

    # ---- runs ------------------------------------------------------------
    def list_runs(self) -> list[dict[str, Any]]:
        """All runs, newest first, with JSON fields decoded."""
        return self._rows("SELECT * FROM runs ORDER BY run_id DESC", decode="runs")

    def latest_run_id(self) -> int | None:
        row = self._one("SELECT max(run_id) AS run_id FROM runs")
        return row["run_id"] if row else None

    def get_run(self, run_id: int) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM runs WHERE run_id = ?", [run_id], decode="runs")
        return rows[0] if rows else None

    def run_summary(self, run_id: int) -> dict[str, Any] | None:
        """Counters and headline latencies of one run (key names are a contract); None if no such run."""
        run = self.get_run(run_id)
        if run is None:
            return None
        counts = self._one(_SUMMARY_SQL, {"run": run_id}) or {}
        by_status = {row["status"]: row["n"] for row in self._rows(_STATUS_SQL, {"run": run_id})}
        latency = self.latency_percentiles(run_id)
        span_ns = counts.get("span_ns") or 0
        output_tokens = counts.get("output_tokens") or 0
        prompt = counts.get("prompt_tokens") or 0
        return {
            "run_id": run_id, "status": run["status"], "model": run["model"], "device": run["device"],
            "requests": counts.get("requests") or 0, **end_state_counts(by_status),
            "preemptions": counts.get("preemptions") or 0,
            "mixed_chunks": counts.get("mixed_chunks") or 0, "plain_chunks": counts.get("plain_chunks") or 0,
            "ticks": counts.get("ticks") or 0, "output_tokens": output_tokens,
            "prefill_tokens": counts.get("prefill_tokens") or 0,
            "duration_s": span_ns / 1e9 if span_ns else None,
            "tokens_per_s": output_tokens / (span_ns / 1e9) if span_ns else None,
            "ttft_p50_ms": latency["ttft"]["p50"], "ttft_p99_ms": latency["ttft"]["p99"],
            "itl_p50_ms": latency["itl"]["p50"], "itl_p99_ms": latency["itl"]["p99"],
            "e2e_p50_ms": latency["e2e"]["p50"], "e2e_p99_ms": latency["e2e"]["p99"],
            "prefix_hit_ratio": (counts.get("prefix_hit_tokens") or 0) / prompt if prompt else None,
            "lever_changes": counts.get("lever_changes") or 0,
            "lever_rejections": counts.get("lever_rejections") or 0,
            "num_dropped": run.get("num_dropped") or 0,
            "writer_wait_ms": (run.get("writer_wait_ns") or 0) / 1e6,
        }

    # ---- tails and windows -----------------------------------------------
    def events_after(self, table: str, run_id: int, after_id: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """Rows of ``table`` with id > after_id, oldest first (the live tail)."""
        if table not in TAILABLE_TABLES:
            raise ValueError(f"cannot tail table {table!r}; one of {', '.join(TAILABLE_TABLES)}")
        return self._rows(f"SELECT * FROM [{table}] WHERE id > ? AND run_id = ? ORDER BY id LIMIT ?",
                          [after_id, run_id, int(limit)], decode=table)

    def requests(self, run_id: int, *, status: str | None = None, limit: int = 10_000) -> list[dict[str, Any]]:
        """Current state of each request (JSON fields decoded), by request id."""
        return self._rows("SELECT * FROM requests WHERE run_id = ? AND (? IS NULL OR status = ?) "
                          "ORDER BY request_id LIMIT ?", [run_id, status, status, int(limit)], decode="requests")

    def window_aggregates(self, run_id: int, t0_ns: int, t1_ns: int | None, bucket_ns: int) -> list[dict[str, Any]]:
        """Per time bucket from ``ticks``: tokens/s, path mix, KV / SSM use. Empty buckets are omitted."""
        if bucket_ns <= 0:
            raise ValueError(f"bucket_ns must be positive, got {bucket_ns}")
        return self._rows(_WINDOW_SQL, {"run": run_id, "t0": t0_ns, "t1": t1_ns, "bucket": bucket_ns})

    def chunk_blockers(self, run_id: int) -> dict[str, int]:
        """How often each can-mix blocker stopped mixing (None key = mixing allowed)."""
        rows = self._rows("SELECT mix_blocker, count(*) AS n FROM chunks WHERE run_id = ? GROUP BY mix_blocker",
                          [run_id])
        return {r["mix_blocker"]: r["n"] for r in rows}

    def latency_percentiles(self, run_id: int, *, since_ns: int | None = None) -> dict[str, dict[str, Any]]:
        """{ttft, itl, e2e: {p50, p90, p99, count}} in milliseconds (None when no samples)."""
        result = {}
        for name in ("ttft", "itl", "e2e"):
            row = self._one(_PERCENTILE_SQL.format(samples=_LATENCY_SAMPLES[name]), {"run": run_id, "since": since_ns})
            result[name] = _to_ms(row)
        return result

    def lever_state(self, run_id: int) -> dict[str, dict[str, Any]]:
        """Each lever: value in force, tick it took effect (None = since start), source, last rejection."""
        run = self.get_run(run_id)
        if run is None:
            return {}
        state = {name: {"value": value, "tick": None, "source": "start", "file_version": None,
                        "last_rejection": None} for name, value in (run.get("levers") or {}).items()}
        for row in self._rows(_LAST_LEVER_SQL, {"run": run_id}, decode="lever_changes"):
            entry = state.setdefault(row["name"], {"value": None, "tick": None, "source": None,
                                                   "file_version": None, "last_rejection": None})
            if row["status"] == "applied":
                entry.update(value=row["new"], tick=row["tick"], source=row["source"],
                             file_version=row["file_version"])
            else:
                entry["last_rejection"] = {"value": row["new"], "reason": row["reason"], "tick": row["tick"],
                                           "source": row["source"], "file_version": row["file_version"]}
        return state


def _decode_json(table: str, row: dict[str, Any]) -> dict[str, Any]:
    for column in _JSON_COLUMNS.get(table, ()):
        value = row.get(column)
        if isinstance(value, str):
            try:
                row[column] = json.loads(value)
            except ValueError:
                pass  # leave text that is not JSON as it was stored
    return row


def end_state_counts(by_status: dict[str, int]) -> dict[str, int]:
    """Requests per end state (each on its own), those still running, and ``errors``: the sum of the
    failure states (error, preempted, rejected), so it cannot read 0 when any request failed.

    ``by_status`` is ``SELECT status, count(*) FROM requests GROUP BY status`` as a dict.
    """
    counts = {status: by_status.get(status, 0) for status in ev.END_STATUSES}
    unknown = sorted(set(by_status) - set(ev.REQUEST_STATUSES))
    counts.update({status: by_status[status] for status in unknown})   # a newer engine's status, shown as is
    counts["running"] = sum(by_status.get(status, 0) for status in ev.IN_FLIGHT_STATUSES)
    counts["errors"] = sum(by_status.get(status, 0) for status in ev.FAILURE_STATUSES)
    return counts


_STATUS_SQL = "SELECT status, count(*) AS n FROM requests WHERE run_id = :run GROUP BY status"

_SUMMARY_SQL = """
SELECT
  (SELECT count(*) FROM requests WHERE run_id = :run) AS requests,
  (SELECT sum(prompt_len) FROM requests WHERE run_id = :run) AS prompt_tokens,
  (SELECT sum(prefix_hit_tokens) FROM requests WHERE run_id = :run) AS prefix_hit_tokens,
  (SELECT count(*) FROM preemptions WHERE run_id = :run) AS preemptions,
  (SELECT count(*) FROM chunks WHERE run_id = :run AND path = 'mixed') AS mixed_chunks,
  (SELECT count(*) FROM chunks WHERE run_id = :run AND path != 'mixed') AS plain_chunks,
  (SELECT count(*) FROM ticks WHERE run_id = :run) AS ticks,
  (SELECT sum(num_prefill_tokens) FROM ticks WHERE run_id = :run) AS prefill_tokens,
  (SELECT max(t_ns + duration_ns) - min(t_ns) FROM ticks WHERE run_id = :run) AS span_ns,
  (SELECT count(*) FROM tokens WHERE run_id = :run) AS output_tokens,
  (SELECT count(*) FROM lever_changes WHERE run_id = :run AND status = 'applied') AS lever_changes,
  (SELECT count(*) FROM lever_changes WHERE run_id = :run AND status != 'applied') AS lever_rejections
"""

_WINDOW_SQL = """
SELECT
  :t0 + ((t_ns - :t0) / :bucket) * :bucket AS bucket_start_ns,
  count(*) AS ticks,
  sum(path = 'mixed') AS mixed, sum(path = 'prefill') AS prefill,
  sum(path = 'decode') AS decode, sum(path = 'idle') AS idle,
  sum(num_prefill_tokens) AS prefill_tokens, sum(num_decode_tokens) AS decode_tokens,
  sum(num_prefill_tokens + num_decode_tokens) * 1e9 / :bucket AS tokens_per_s,
  sum(num_decode_tokens) * 1e9 / :bucket AS decode_tokens_per_s,
  max(kv_blocks_used) AS kv_blocks_used_max, avg(kv_blocks_used) AS kv_blocks_used_avg,
  max(kv_blocks_total) AS kv_blocks_total, max(ssm_slots_used) AS ssm_slots_used_max,
  avg(num_active) AS active_avg, max(num_waiting) AS waiting_max,
  sum(duration_ns) AS busy_ns
FROM ticks
WHERE run_id = :run AND t_ns >= :t0 AND (:t1 IS NULL OR t_ns < :t1)
GROUP BY bucket_start_ns ORDER BY bucket_start_ns
"""

_LAST_LEVER_SQL = """
SELECT * FROM lever_changes WHERE id IN (
  SELECT max(id) FROM lever_changes WHERE run_id = :run GROUP BY name, status = 'applied')
ORDER BY id
"""

# Latency samples in ns, one query each; ``:since`` limits to recent samples (live view).
_LATENCY_SAMPLES = {
    "ttft": "SELECT first_token_ns - arrival_ns AS v FROM requests WHERE run_id = :run "
            "AND first_token_ns IS NOT NULL AND arrival_ns IS NOT NULL "
            "AND (:since IS NULL OR first_token_ns >= :since)",
    "e2e": "SELECT finished_ns - arrival_ns AS v FROM requests WHERE run_id = :run "
           "AND finished_ns IS NOT NULL AND arrival_ns IS NOT NULL "
           "AND (:since IS NULL OR finished_ns >= :since)",
    # Gap between consecutive tokens of one request (window over the request's tokens).
    "itl": "SELECT v FROM (SELECT t_ns - lag(t_ns) OVER (PARTITION BY request_id ORDER BY [index]) AS v, "
           "t_ns FROM tokens WHERE run_id = :run) WHERE v IS NOT NULL AND (:since IS NULL OR t_ns >= :since)",
}

# Nearest-rank percentile: the value at rank ceil(p * n) of the sorted samples
# (integer arithmetic: (k * n + 99) / 100 is ceil(k% of n) without float rounding).
_PERCENTILE_SQL = """
WITH samples AS ({samples}),
ranked AS (SELECT v, row_number() OVER (ORDER BY v) AS rank, count(*) OVER () AS n FROM samples)
SELECT max(n) AS count,
  max(CASE WHEN rank = max(1, (50 * n + 99) / 100) THEN v END) AS p50,
  max(CASE WHEN rank = max(1, (90 * n + 99) / 100) THEN v END) AS p90,
  max(CASE WHEN rank = max(1, (99 * n + 99) / 100) THEN v END) AS p99
FROM ranked
"""


def _to_ms(row: dict[str, Any] | None) -> dict[str, Any]:
    row = row or {}
    return {"count": row.get("count") or 0,
            **{p: (row[p] / 1e6 if row.get(p) is not None else None) for p in ("p50", "p90", "p99")}}
