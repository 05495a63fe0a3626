"""Soak: a serving engine for a long while; the -wal file must stay bounded, page times must not grow.

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 8] [--sample-s 30] [--page-repeats 3] [--run-dir DIR]

Starts ``python -m engine serve --model tiny`` (endless synthetic workload) on a
fresh run dir and, every ``--sample-s`` seconds, records: the engine's tick and
RSS, ``telemetry.db`` and ``-wal`` sizes, and the cold render time of every
dashboard page (Streamlit's AppTest, caches cleared; the fastest of
``--page-repeats``) against the live store.
At the end it prints the table and the verdicts:
- WAL bounded: the largest -wal seen stays under ``--wal-bound-mb``;
- pages flat: each page's mean time over the last third of samples is at most
  ``--page-growth`` times its mean over the first third;
- RSS bounded: the engine's mean resident memory over the last third of samples is at
  most ``--rss-growth-mb`` above its mean over the first third (the engine's fast paths:
  prepacked weights, oneDNN's per-shape state, compiled graphs, must not grow with ticks).
``--engine-args "..."`` passes more flags to ``serve`` (e.g. ``--dtype bfloat16``).
Exit status 0 when all hold, 1 otherwise. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PAGES = ("live", "chunks", "requests", "levers", "runs")


def file_mb(path: Path) -> float:
    try:
        return path.stat().st_size / 2**20
    except OSError:
        return 0.0


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def page_times(run_dir: Path, repeats: int = 1) -> dict[str, float]:
    """Cold render seconds per page (what a new browser tab costs against the store as it is now).

    For each page, ``PAGE`` is wall seconds and ``PAGE_cpu`` the CPU seconds this process spent
    (the render runs in AppTest's script thread; nothing else here is busy meanwhile), each the
    fastest of ``repeats`` cold renders. On a shared machine wall time mostly measures the
    neighbours; CPU time measures the page's own work.
    """
    import logging

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    for name in ("streamlit", "streamlit.runtime"):   # bare-mode warnings on every AppTest
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ["CHUNKSCOPE_RUN_DIR"] = str(run_dir)
    times = {}
    for page in PAGES:
        st.cache_data.clear()
        at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
        at.run()
        if page != "live":
            at.switch_page(f"app_pages/{page}.py")
        for _ in range(repeats):
            st.cache_data.clear()
            start, start_cpu = time.perf_counter(), time.process_time()
            at.run()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            times[page] = min(times.get(page, elapsed), elapsed)
            times[f"{page}_cpu"] = min(times.get(f"{page}_cpu", elapsed_cpu), elapsed_cpu)
            if at.exception:
                raise SystemExit(f"page {page} raised: {at.exception[0].value}")
    return times


def engine_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "engine_status.json").read_text())
    except (OSError, ValueError):
        return {}


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=8.0, help="synthetic arrivals per second")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a fresh temp dir")
    parser.add_argument("--wal-bound-mb", type=float, default=48.0)
    parser.add_argument("--page-growth", type=float, default=1.5)
    parser.add_argument("--rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--engine-args", default="", help="extra flags for `python -m engine serve`")
    parser.add_argument("--page-repeats", type=int, default=3, help="cold renders per page per sample (min kept)")
    parser.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                        help="which page time the flatness verdict uses (both are printed)")
    args = parser.parse_args()
    os.chdir(ROOT)   # .streamlit/config.toml
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="chunkscope-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    engine = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                               "--rate", str(args.rate), *args.engine_args.split()], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(run_dir / "soak_engine.stderr", "wb"))
    db = run_dir / "telemetry.db"
    samples: list[dict] = []
    print(f"soak: {args.minutes} min at {args.rate} req/s, run dir {run_dir}", flush=True)
    try:
        while engine_status(run_dir).get("tick", 0) < 1:
            if engine.poll() is not None:
                raise SystemExit(f"engine exited with {engine.returncode}; see {run_dir}/soak_engine.stderr")
            time.sleep(0.5)
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            times = page_times(run_dir, args.page_repeats)
            status = engine_status(run_dir)
            sample = {"t_s": time.monotonic() - started, "tick": status.get("tick"),
                      "telemetry": status.get("telemetry"), "rss_mb": rss_mb(engine.pid),
                      "db_mb": file_mb(db), "wal_mb": file_mb(Path(f"{db}-wal")), **times}
            samples.append(sample)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in sample.items()),
                  flush=True)
            if engine.poll() is not None:
                raise SystemExit(f"engine exited with {engine.returncode} during the soak")
            time.sleep(max(0.0, args.sample_s - sum(times[p] for p in PAGES)))
    finally:
        if engine.poll() is None:
            engine.send_signal(signal.SIGTERM)
            engine.wait(timeout=60)
    third = max(1, len(samples) // 3)
    max_wal = max(s["wal_mb"] for s in samples)

    def thirds(key: str) -> tuple[float, float]:
        """Mean of ``key`` over the first and over the last third of the samples."""
        return mean([s[key] for s in samples[:third]]), mean([s[key] for s in samples[-third:]])

    print(f"\nsamples {len(samples)}, ticks {samples[-1]['tick']}, db {samples[-1]['db_mb']:.1f} MB, "
          f"max -wal {max_wal:.2f} MB (bound {args.wal_bound_mb} MB), "
          f"engine RSS first {samples[0]['rss_mb']:.0f} MB / last {samples[-1]['rss_mb']:.0f} MB")
    growth = {}
    for clock, suffix in (("cpu", "_cpu"), ("wall", "")):
        parts = []
        for page in PAGES:
            first, last = thirds(page + suffix)
            ratio = last / max(1e-6, first)
            parts.append(f"{page} {ratio:.2f}x ({first:.3f} -> {last:.3f} s)")
            if clock == args.clock:
                growth[page] = ratio
        print(f"page {clock} time, last third / first third: " + ", ".join(parts))
    is_wal_ok = max_wal < args.wal_bound_mb
    is_pages_ok = all(g <= args.page_growth for g in growth.values())
    rss_first, rss_last = thirds("rss_mb")
    is_rss_ok = rss_last - rss_first <= args.rss_growth_mb
    print(f"engine RSS mean, first third {rss_first:.0f} MB, last third {rss_last:.0f} MB, "
          f"max {max(s['rss_mb'] for s in samples):.0f} MB")
    print(f"WAL bounded: {'yes' if is_wal_ok else 'NO'}; page {args.clock} times flat (<= {args.page_growth}x): "
          f"{'yes' if is_pages_ok else 'NO'}; RSS bounded (+{rss_last - rss_first:.0f} MB <= "
          f"{args.rss_growth_mb:.0f} MB): {'yes' if is_rss_ok else 'NO'}")
    return 0 if is_wal_ok and is_pages_ok and is_rss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
