import json
import os
import signal
import subprocess
import sys
import time

import pytest

from telemetry import events as ev
from telemetry.__main__ import main
from telemetry.writer import TelemetryWriter

from telemetry_factories import make_run_started, one_of_each

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def store(db_path):
    with TelemetryWriter(db_path) as writer:
        writer.start_run(make_run_started())
        for event in one_of_each():
            writer.emit(event)
    return db_path


def test_runs_table_and_json(store, capsys):
    assert main(["runs", "--db", store]) == 0
    assert "finished" in capsys.readouterr().out
    assert main(["runs", "--db", store, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert runs[0]["run_id"] == 1 and runs[0]["num_events"] == len(one_of_each())


def test_runs_on_missing_db(tmp_path, capsys):
    """A path that holds no store is an error (exit 1, one line), never an empty listing with exit 0."""
    for argv in (["runs"], ["summary", "--json"], ["tail", "--once"]):
        assert main([*argv, "--db", str(tmp_path / "none.db")]) == 1
        assert capsys.readouterr().err == f"error: no telemetry store at {tmp_path / 'none.db'}\n"
    assert main(["runs", "--db", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "is a directory, not a telemetry store" in err and "disk I/O" not in err
    (tmp_path / "empty.db").write_bytes(b"")
    assert main(["runs", "--db", str(tmp_path / "empty.db")]) == 0
    assert "no telemetry yet" in capsys.readouterr().out


def test_tail_once_on_an_unknown_run_is_an_error(store, capsys):
    assert main(["tail", "--db", store, "--run", "77", "--once"]) == 1
    assert capsys.readouterr().err == f"error: no run 77 in {store}\n"


def test_summary_json_contract(store, capsys):
    assert main(["summary", "--db", store, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("requests", "finished", "errors", "preemptions", "mixed_chunks", "plain_chunks", "ticks",
                "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "prefix_hit_ratio", "lever_changes"):
        assert key in summary
    assert summary["mixed_chunks"] == 1 and summary["preemptions"] == 1 and summary["lever_changes"] == 1
    assert main(["summary", "--db", store, "--run", "9", "--json"]) == 1
    assert "no run 9" in capsys.readouterr().err


def test_tail_once_prints_every_kind(store, capsys):
    assert main(["tail", "--db", store, "--once"]) == 0
    out = capsys.readouterr().out
    for table in ("ticks", "chunks", "stream_events", "preemptions", "request_events", "tokens",
                  "lever_changes", "events"):
        assert f" {table} " in out


def test_tail_follows_and_exits_cleanly_on_ctrl_c(db_path):
    writer = TelemetryWriter(db_path, flush_interval_s=0.01)
    writer.start_run(make_run_started())
    proc = subprocess.Popen([sys.executable, "-m", "telemetry", "tail", "--db", db_path, "--interval", "0.05"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        writer.emit(ev.GenericEvent(tick=42, t_ns=7, kind="marker_for_tail"))
        writer.flush()
        deadline = time.monotonic() + 10
        line = ""
        while "marker_for_tail" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert "marker_for_tail" in line and "tick     42" in line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        writer.close()


def test_levers_set_get_validate(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CHUNKSCOPE_SLICE_BUDGET", raising=False)
    path = str(tmp_path / "levers.json")
    assert main(["levers", "set", "slice_budget", "32", "--file", path]) == 0
    assert main(["levers", "set", "always_mixed", "true", "--file", path]) == 0
    assert json.load(open(path)) == {"version": 2, "levers": {"always_mixed": True, "slice_budget": 32}}
    capsys.readouterr()
    assert main(["levers", "get", "--file", path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["version"] == 2 and got["levers"]["slice_budget"] == 32 and got["levers"]["speculation"] == "off"
    assert main(["levers", "validate", path]) == 0
    assert main(["levers", "set", "slice_budget", "0", "--file", path]) == 2
    assert "outside" in capsys.readouterr().err
    assert json.load(open(path))["version"] == 2  # rejected set leaves the file alone
    assert main(["levers", "list"]) == 0


@pytest.mark.parametrize("content", [b"", b"\x00\x01binary", b'{"version": 1, "levers": {"turbo": 1}}',
                                     b'{"version": 1, "levers": {"slice_budget": tr', b"x" * 70_000])
def test_levers_validate_rejects_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main(["levers", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err


def test_levers_validate_process_exit_code_without_traceback(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe binary")
    proc = subprocess.run([sys.executable, "-m", "telemetry", "levers", "validate", str(path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "UTF-8" in proc.stderr


def test_levers_validate_missing_file(tmp_path, capsys):
    assert main(["levers", "validate", str(tmp_path / "absent.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_levers_set_refuses_to_overwrite_a_broken_file(tmp_path, capsys):
    path = tmp_path / "levers.json"
    path.write_bytes(b"{broken")
    assert main(["levers", "set", "kv_blocks_cap", "8", "--file", str(path)]) == 2
    assert path.read_bytes() == b"{broken"
