"""Bug-report bundle size per 10 minutes of a default run (the figure docs/benchmarks.md quotes).

usage: python bench/bundle_size.py [--minutes 10] [--rate 4] [--run-dir DIR]

Serves the tiny model with ``./run.sh``'s workload (``serve --model tiny --workload synthetic``,
its default rate) for ``--minutes``, stops it (SIGTERM: the telemetry drains), exports the run
with ``python -m telemetry export`` and prints the bundle's size, each member's size (stored and
compressed), the size scaled to 10 minutes of that run, the CPU model and the dtype. A shorter run
scales linearly only while the engine keeps up with the rate, and the size follows the ticks (a
quieter machine ticks faster and writes more rows): the ticks/s and bytes-per-tick lines say so.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.model.cpu_features import cpu_model  # noqa: E402


def serve(run_dir: Path, minutes: float, rate: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
            "--workload", "synthetic", "--rate", str(rate), "--duration", str(minutes * 60)]
    with open(run_dir / "serve.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=minutes * 60 + 300)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if proc.returncode != 0:
        sys.exit(f"serve exited {proc.returncode}: {(run_dir / 'serve.log').read_text()[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the engine serves (default 10)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s (default 4: ./run.sh's synthetic rate)")
    parser.add_argument("--run-dir", default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="bundle-size-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    serve(run_dir, args.minutes, args.rate)
    served_s = time.monotonic() - start
    bundle = run_dir / "bundle.zip"
    subprocess.run([sys.executable, "-m", "telemetry", "export", "--db", str(run_dir / "telemetry.db"),
                    "-o", str(bundle), "--force"], cwd=ROOT, check=True)
    conn = sqlite3.connect(run_dir / "telemetry.db")
    num_ticks, span_ns = conn.execute("SELECT COUNT(*), MAX(t_ns + duration_ns) FROM ticks").fetchone()
    num_requests = conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    dtype = json.loads(conn.execute("SELECT config FROM runs ORDER BY run_id DESC").fetchone()[0] or "{}").get("dtype")
    conn.close()
    minutes = (span_ns or 0) / 60e9
    size_mb = bundle.stat().st_size / 1e6
    print(f"# bench/bundle_size.py on {cpu_model()} ({os.cpu_count()} CPUs), dtype {dtype}, tiny, synthetic at "
          f"{args.rate:g} req/s, {minutes:.2f} min of run ({served_s:.0f} s wall with start-up)")
    print(f"run: {num_ticks:,} ticks ({num_ticks / max(minutes * 60, 1e-9):.0f} ticks/s), {num_requests:,} requests")
    with zipfile.ZipFile(bundle) as zf:
        for info in zf.infolist():
            print(f"  {info.filename:<16} {info.file_size / 1e6:8.2f} MB stored as {info.compress_size / 1e6:6.2f} MB")
    print(f"bundle: {size_mb:.2f} MB = {size_mb / max(minutes, 1e-9) * 10:.2f} MB per 10 min of this run; "
          f"{bundle.stat().st_size / max(num_ticks, 1):.0f} bytes per tick (the size follows the tick rate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
