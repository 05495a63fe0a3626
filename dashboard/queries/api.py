"""Where requests come from (API clients or the engine's workload) and which first-token rules fired.

Bounded like the Live page's latency percentiles: the newest ``RECENT_REQUESTS`` requests,
a primary-key range scan, so the cost stays flat however long the run grows.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from dashboard.queries.db import query_df, query_one

RECENT_REQUESTS = 2_000


def api_activity(db: Path, run_id: int, end_ns: int, window_s: float) -> dict:
    """API request rate over the window, requests by source and first-token rule counts (newest requests)."""
    newest = query_one(db, "SELECT MAX(request_id) AS v FROM requests WHERE run_id = ?", [run_id])
    bound = (newest["v"] if newest and newest["v"] is not None else 0) - RECENT_REQUESTS
    frame = query_df(db, "SELECT coalesce(source, 'workload') AS source, first_token_rules, arrival_ns "
                         "FROM requests WHERE run_id = ? AND request_id > ?", [run_id, bound])
    start_ns = end_ns - window_s * 1e9
    is_api = frame["source"] == "api"
    recent_api = int((is_api & (frame["arrival_ns"] >= start_ns)).sum())
    rules = Counter(rule for text in frame["first_token_rules"].dropna() for rule in str(text).split(",") if rule)
    return {"api_rate": recent_api / window_s if window_s > 0 else 0.0,
            "by_source": {str(k): int(v) for k, v in frame["source"].value_counts().items()},
            "rules": dict(sorted(rules.items())), "num_requests": len(frame)}
