"""The store under load and under kill -9, with the writer in its own process."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

from telemetry.reader import TelemetryReader
from telemetry.crashed_runs import mark_crashed_runs

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_child.py")
NUM_ROWS = 1_000_000
WAL_BOUND_BYTES = 48 << 20   # writer truncates past 4 MiB; allow slack for a reader pinning a snapshot


def _wal_size(db_path):
    try:
        return os.path.getsize(db_path + "-wal")
    except OSError:
        return 0


def test_reader_polls_while_writer_writes_a_million_rows_wal_bounded(db_path):
    child = subprocess.Popen([sys.executable, CHILD, db_path, str(NUM_ROWS)], stdout=subprocess.PIPE, text=True)
    reader = TelemetryReader(db_path)
    assert child.stdout.readline().strip() == "started"
    max_wal, seen, num_polls = 0, 0, 0
    deadline = time.monotonic() + 240
    while child.poll() is None and time.monotonic() < deadline:
        # what a live dashboard does a few times a second: a tail and a windowed aggregate
        head = reader.events_after("ticks", 1, 0, limit=1)
        recent = reader.window_aggregates(1, max(0, seen - 20_000) * 1000, None, 1_000_000)
        if recent:
            newest = recent[-1]["bucket_start_ns"] // 1000
            assert newest >= seen - 1000, "reads must move forward"
            seen = newest
        assert not head or head[0]["tick"] == 0
        max_wal = max(max_wal, _wal_size(db_path))
        num_polls += 1
        time.sleep(0.02)
    print(f"max -wal size {max_wal / 2**20:.1f} MiB over {num_polls} polls")
    assert child.wait(timeout=30) == 0
    assert num_polls > 10, "the reader must have polled during the write"
    assert max_wal < WAL_BOUND_BYTES, f"-wal grew to {max_wal} bytes"
    conn = sqlite3.connect(db_path)
    assert conn.execute("SELECT count(*), min(tick), max(tick) FROM ticks").fetchone() == (NUM_ROWS, 0, NUM_ROWS - 1)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert TelemetryReader(db_path).run_summary(1)["ticks"] == NUM_ROWS


def test_kill_9_keeps_every_acknowledged_batch(db_path):
    child = subprocess.Popen([sys.executable, CHILD, db_path, "0", "--ack"], stdout=subprocess.PIPE, text=True)
    acked = 0
    try:
        assert child.stdout.readline().strip() == "started"
        while acked < 50_000:
            line = child.stdout.readline()
            assert line, "writer child died early"
            acked = max(acked, int(line.split()[1]))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    for line in child.stdout:  # acks printed before the kill are still in the pipe
        if line.startswith("ack"):
            acked = max(acked, int(line.split()[1]))
    conn = sqlite3.connect(db_path)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    count, distinct, top = conn.execute(
        "SELECT count(*), count(DISTINCT tick), max(tick) FROM ticks WHERE tick < ?", [acked]).fetchone()
    assert count == distinct == acked and top == acked - 1
    assert conn.execute("SELECT status FROM runs").fetchone() == ("running",)
    assert mark_crashed_runs(db_path) == [1]
    assert conn.execute("SELECT status FROM runs").fetchone() == ("crashed",)
