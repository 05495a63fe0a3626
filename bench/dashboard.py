"""Dashboard render time per page against a generated 1,000,000-event telemetry store.

    .venv/bin/python bench/dashboard.py [--events 1000000] [--db PATH] [--repeat 3]

Builds the store once with the real telemetry writer from the synthetic
scheduler simulation (tests/dashboard/synthetic_run.py; cached under
.chunkscope-cache/), then runs every page through Streamlit's AppTest and
prints cold (caches cleared) and warm render times. Target: every page cold
under 1.5 s.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sqlite3
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "dashboard"))

import synthetic_run  # noqa: E402

TARGET_S = 1.5
PAGES = ("live", "chunks", "requests", "levers", "runs")


def build_store(db: Path, num_events: int) -> None:
    from tqdm import tqdm

    probe = synthetic_run.SimConfig(num_requests=200, seed=1)
    per_request = sum(1 for _ in synthetic_run.simulate(probe)) / probe.num_requests
    cfg = dataclasses.replace(synthetic_run.SimConfig(), num_requests=int(num_events / per_request), seed=1,
                              bisect_on_tick=50_000, bisect_off_tick=120_000)
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_suffix(".building")
    for suffix in ("", "-wal", "-shm"):
        Path(str(tmp) + suffix).unlink(missing_ok=True)
    with tqdm(total=num_events, unit="ev", desc="writing store") as bar:
        synthetic_run.write_run(tmp, dataclasses.replace(cfg, num_requests=50, seed=2), status="crashed")
        synthetic_run.write_run(tmp, cfg, status="finished", progress=bar.update)
    os.replace(tmp, db)


def count_events(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT SUM(num_events) FROM runs").fetchone()[0] or 0)
    finally:
        conn.close()


def time_pages(db: Path, repeat: int) -> dict[str, tuple[float, float]]:
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    os.environ["CHUNKSCOPE_RUN_DIR"] = str(db.parent)
    app = str(ROOT / "dashboard" / "app.py")
    results = {}
    for page in PAGES:
        cold, warm = [], []
        for _ in range(repeat):
            st.cache_data.clear()
            at = AppTest.from_file(app, default_timeout=60)
            at.session_state["chosen_run"] = 2          # the big run
            at.run()
            if page != "live":
                at.switch_page(f"app_pages/{page}.py")
            start = time.perf_counter()
            st.cache_data.clear()
            at.run()
            cold.append(time.perf_counter() - start)
            if at.exception:
                raise SystemExit(f"page {page} raised: {at.exception[0].value}")
            start = time.perf_counter()
            at.run()
            warm.append(time.perf_counter() - start)
        results[page] = (min(cold), min(warm))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--db", type=Path, default=ROOT / ".chunkscope-cache" / "bench-dashboard" / "telemetry.db")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not args.db.exists() or count_events(args.db) < args.events * 0.95:
        build_store(args.db, args.events)
    num_events = count_events(args.db)
    print(f"store {args.db}: {num_events:,} events, {args.db.stat().st_size / 1e6:.0f} MB")
    results = time_pages(args.db, args.repeat)
    print(f"{'page':<10} {'cold s':>8} {'warm s':>8}  (target cold < {TARGET_S} s)")
    for page, (cold, warm) in results.items():
        flag = "ok" if cold < TARGET_S else "SLOW"
        print(f"{page:<10} {cold:8.3f} {warm:8.3f}  {flag}")
    worst = max(cold for cold, _ in results.values())
    print(f"worst cold page / target = {worst / TARGET_S:.2f}")


if __name__ == "__main__":
    main()
