import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from telemetry import events as ev
from telemetry.crashed_runs import mark_crashed_runs
from telemetry.writer import TelemetryWriteError, TelemetryWriter

from telemetry_factories import make_run_started


def _count(db_path, table):
    return sqlite3.connect(db_path).execute(f"SELECT count(*) FROM [{table}]").fetchone()[0]


def test_events_are_committed_in_order_and_acknowledged(db_path):
    writer = TelemetryWriter(db_path, max_batch=100, queue_size=1000)
    writer.start_run(make_run_started())
    for i in range(1050):
        writer.emit(ev.TokenEvent(tick=i, t_ns=i, request_id=i % 3, index=i, token_id=i))
    assert writer.flush()
    assert writer.flushed_events == 1050
    assert writer.flushed_batches >= 11  # max_batch caps each transaction
    ticks = [r[0] for r in sqlite3.connect(db_path).execute("SELECT tick FROM tokens ORDER BY id")]
    assert ticks == list(range(1050))
    writer.close()
    run = sqlite3.connect(db_path).execute("SELECT status, num_events, finished_at FROM runs").fetchone()
    assert run[0] == "finished" and run[1] == 1050 and run[2] is not None


def test_flush_interval_commits_without_close(db_path):
    writer = TelemetryWriter(db_path, flush_interval_s=0.02)
    writer.start_run(make_run_started())
    writer.emit(ev.Tick(tick=1, t_ns=5))
    deadline = time.monotonic() + 2
    while _count(db_path, "ticks") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _count(db_path, "ticks") == 1  # visible to another connection within the flush interval
    writer.close()


def test_request_rows_are_upserted_last_state_wins(db_path):
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started())
        writer.emit(ev.RequestRecord(tick=0, t_ns=1, request_id=4, status=ev.REQ_WAITING))
        writer.emit(ev.RequestRecord(tick=1, t_ns=2, request_id=4, status=ev.REQ_DECODING, output_len=1))
        assert writer.flush()
        writer.emit(ev.RequestRecord(tick=5, t_ns=9, request_id=4, status=ev.REQ_FINISHED, output_len=3))
        writer.emit(ev.RequestRecord(tick=5, t_ns=9, request_id=5, status=ev.REQ_WAITING))
    rows = sqlite3.connect(db_path).execute(
        "SELECT run_id, request_id, status, output_len FROM requests ORDER BY request_id").fetchall()
    assert rows == [(run_id, 4, "finished", 3), (run_id, 5, "waiting", 0)]


def test_full_queue_blocks_producer_and_records_wait(db_path):
    writer = TelemetryWriter(db_path, queue_size=10, max_batch=10, flush_interval_s=0.01)
    writer.start_run(make_run_started())
    for i in range(2000):
        writer.emit(ev.Tick(tick=i, t_ns=i))
    writer.close()
    assert writer.num_dropped == 0
    assert writer.writer_wait_ns > 0
    conn = sqlite3.connect(db_path)
    assert conn.execute("SELECT count(*) FROM ticks").fetchone()[0] == 2000
    assert conn.execute("SELECT writer_wait_ns, num_dropped FROM runs").fetchone() == (writer.writer_wait_ns, 0)


def test_emit_needs_a_run(db_path):
    writer = TelemetryWriter(db_path)
    with pytest.raises(RuntimeError, match="start_run"):
        writer.emit(ev.Tick(tick=0, t_ns=0))
    writer.start_run(make_run_started())
    writer.close()
    with pytest.raises(RuntimeError):
        writer.emit(ev.Tick(tick=0, t_ns=0))


def test_unopenable_store_fails_start_run_fast(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    writer = TelemetryWriter(str(blocker / "telemetry.db"))
    started = time.monotonic()
    with pytest.raises(TelemetryWriteError, match="cannot start a run"):
        writer.start_run(make_run_started(), timeout_s=10)
    assert time.monotonic() - started < 5
    assert writer.error and "unable to open" in writer.error
    writer.close()  # no hang, no raise


def test_locked_store_drops_counted_then_recovers(db_path):
    writer = TelemetryWriter(db_path, queue_size=50, max_batch=50, flush_interval_s=0.01,
                             busy_timeout_ms=20, max_backoff_s=0.05)
    writer.start_run(make_run_started())
    locker = sqlite3.connect(db_path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
    started = time.monotonic()
    num_emitted = 0
    for i in range(500):
        writer.emit(ev.Tick(tick=i, t_ns=i))
        num_emitted += 1
    deadline = time.monotonic() + 5
    while writer.num_dropped == 0 and time.monotonic() < deadline:
        writer.emit(ev.Tick(tick=-1, t_ns=0))
        num_emitted += 1
        time.sleep(0.01)
    assert time.monotonic() - started < 6, "producer must not block on a failing store"
    assert writer.error and "locked" in writer.error
    assert writer.num_dropped > 0
    locker.execute("ROLLBACK")
    locker.close()
    writer.close()
    conn = sqlite3.connect(db_path)
    status, dropped, error = conn.execute("SELECT status, num_dropped, writer_error FROM runs").fetchone()
    assert status == "finished" and dropped == writer.num_dropped and "locked" in error
    committed = conn.execute("SELECT count(*) FROM ticks").fetchone()[0]
    assert committed == writer.flushed_events > 0
    assert committed + writer.num_dropped == num_emitted  # every event is either stored or counted


def test_emit_from_several_threads(db_path):
    with TelemetryWriter(db_path, queue_size=200, max_batch=100) as writer:
        writer.start_run(make_run_started())
        def produce(offset):
            for i in range(1000):
                writer.emit(ev.TokenEvent(tick=i, t_ns=i, request_id=offset, index=i, token_id=i))
        threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows = sqlite3.connect(db_path).execute(
        "SELECT request_id, count(*), count(DISTINCT [index]) FROM tokens GROUP BY request_id").fetchall()
    assert rows == [(k, 1000, 1000) for k in range(4)]


def test_mark_crashed_runs_uses_pid_liveness(db_path):
    with TelemetryWriter(db_path) as writer:
        dead_run = writer.start_run(make_run_started())
    for _ in range(2):
        with TelemetryWriter(db_path) as writer:
            writer.start_run(make_run_started())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        conn = sqlite3.connect(db_path)
        conn.execute("UPDATE runs SET status = 'running', pid = ? WHERE run_id = ?", [dead_pid, dead_run])
        conn.execute("UPDATE runs SET status = 'running', pid = ? WHERE run_id = ?", [live.pid, dead_run + 1])
        conn.execute("UPDATE runs SET status = 'running', pid = ? WHERE run_id = ?", [os.getpid(), dead_run + 2])
        conn.commit()
        assert mark_crashed_runs(db_path) == [dead_run]
        statuses = [r[0] for r in conn.execute("SELECT status FROM runs ORDER BY run_id")]
        assert statuses == ["crashed", "running", "running"]
    finally:
        live.kill()
        live.wait()


def test_mark_crashed_runs_on_missing_db(tmp_path):
    assert mark_crashed_runs(tmp_path / "none.db") == []
    assert not (tmp_path / "none.db").exists()


def test_an_idle_writer_stops_checkpointing_once_the_wal_is_copied_back(db_path):
    """A blocked or idle engine writes nothing: a checkpoint a second would only burn CPU beside the
    dashboard's readers. One held back by a reader's snapshot is retried until it completes."""
    writer = TelemetryWriter(db_path, flush_interval_s=0.01, checkpoint_interval_s=0.02)
    try:
        writer.start_run(make_run_started())
        reader = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM ticks").fetchone()       # a snapshot: frames it sees stay
        for i in range(20):
            writer.emit(ev.Tick(tick=i, t_ns=i))
        assert writer.flush()
        time.sleep(0.2)
        held_back = writer.num_checkpoints
        time.sleep(0.2)
        assert writer.num_checkpoints > held_back, "a checkpoint a reader held back was not retried"
        reader.rollback()
        reader.close()
        time.sleep(0.2)                    # the retry now copies everything back
        settled = writer.num_checkpoints
        time.sleep(0.4)                    # ~20 intervals with nothing written
        assert writer.num_checkpoints == settled, \
            f"{writer.num_checkpoints - settled} checkpoints while nothing was written"
        writer.emit(ev.Tick(tick=99, t_ns=99))
        assert writer.flush()
        time.sleep(0.2)
        assert writer.num_checkpoints > settled        # new rows: checkpointed again
    finally:
        writer.close()
