"""Bundles of a synthetic store: complete, self-consistent, private, windowed, and safely refused when bad."""
from __future__ import annotations

import gzip
import json
import re
import sqlite3
import zipfile

import pytest

from telemetry import events as ev
from telemetry.__main__ import main as telemetry_main
from telemetry.bundle import BUNDLE_MEMBERS, BundleError, open_bundle
from telemetry.bundle_export import EXPORT_STEPS, export_bundle

from bundle_store import MS, OUTSIDE_PATH, build_store
from trace_validator import validate_trace

ENVIRON = {"OMP_NUM_THREADS": "2", "CHUNKSCOPE_MAX_PREFILL_TOKENS": "128", "HOME": "/home/secret-user",
           "AWS_SECRET_ACCESS_KEY": "hunter2", "CHUNKSCOPE_CACHE": "/home/secret-user/.cache/chunkscope",
           "PATH": "/usr/bin"}


@pytest.fixture
def run_dir(tmp_path):
    build_store(tmp_path)
    return tmp_path


@pytest.fixture
def bundle(run_dir):
    export_bundle(run_dir / "telemetry.db", run_dir / "b.zip", environ=ENVIRON)
    with open_bundle(run_dir / "b.zip") as opened:
        yield opened


def _rows(db, sql):
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql)]
    finally:
        conn.close()


def test_bundle_holds_every_member_of_the_latest_run_only(bundle):
    assert sorted(zipfile.ZipFile(bundle.path).namelist()) == sorted(BUNDLE_MEMBERS)
    assert bundle.run_id == 2
    assert _rows(bundle.db_path, "SELECT DISTINCT run_id FROM ticks") == [{"run_id": 2}]
    assert all(_rows(bundle.db_path, f"SELECT count(*) AS n FROM [{t}] WHERE run_id != 2")[0]["n"] == 0
               for t in ev.TABLES)
    counts = bundle.manifest["counts"]
    assert counts == {t: _rows(bundle.db_path, f"SELECT count(*) AS n FROM [{t}]")[0]["n"] for t in ev.TABLES}
    assert counts["ticks"] == 40 and counts["requests"] == 10


def test_snapshot_ships_without_indexes_and_open_rebuilds_them(bundle, tmp_path):
    shipped = tmp_path / "shipped.db"
    shipped.write_bytes(zipfile.ZipFile(bundle.path).read("telemetry.db"))
    index_sql = "SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'idx_%' ORDER BY name"
    assert _rows(shipped, index_sql) == []
    names = {r["name"] for r in _rows(bundle.db_path, index_sql)}
    assert {"idx_tokens_run_id_request_id_index", "idx_ticks_run_id_t_ns", "idx_chunks_run_id_tick"} <= names


def test_workload_matches_the_snapshot_requests(bundle):
    requests = {r["request_id"]: r for r in _rows(bundle.db_path, "SELECT * FROM requests")}
    assert [w["request_id"] for w in bundle.workload] == sorted(requests, key=lambda i: (requests[i]["arrival_tick"], i))
    for row in bundle.workload:
        stored = requests[row["request_id"]]
        assert row["prompt_tokens"] == json.loads(stored["prompt_tokens"])
        assert row["sampling"] == json.loads(stored["sampling"]) and row["seed"] == row["sampling"]["seed"]
        assert (row["arrival_tick"], row["arrival_ns"]) == (stored["arrival_tick"], stored["arrival_ns"])
        assert row["arrival_s"] == pytest.approx(stored["arrival_ns"] / 1e9)


def test_manifest_agrees_with_the_snapshot(bundle):
    manifest = bundle.manifest
    assert manifest["run"]["run_id"] == 2 and manifest["schema_version"] == ev.SCHEMA_VERSION
    extent = _rows(bundle.db_path, "SELECT min(t_ns) AS a, max(t_ns) AS b, min(tick) AS c, max(tick) AS d "
                                   "FROM ticks")[0]
    time_range = manifest["time_range"]
    assert time_range["is_windowed"] is False
    assert (time_range["first_ns"], time_range["first_tick"], time_range["last_tick"]) == (extent["a"], 0, 39)
    assert time_range["last_ns"] >= extent["b"]
    changes = _rows(bundle.db_path, "SELECT * FROM lever_changes ORDER BY tick, id")
    assert [(c["tick"], c["name"], c["new"], c["status"]) for c in bundle.lever_timeline["changes"]] == \
        [(c["tick"], c["name"], json.loads(c["new"]), c["status"]) for c in changes]
    assert bundle.lever_timeline["start"] == {"bisect_no_mix": False, "max_prefill_tokens": 256}
    assert [c["name"] for c in bundle.applied_lever_changes] == ["max_prefill_tokens", "bisect_no_mix"]
    for key in ("versions", "device", "engine_config", "model_config", "command_line", "chunkscope"):
        assert key in manifest
    assert set(manifest["versions"]["exporter"]) >= {"python", "sqlite", "torch", "streamlit", "plotly", "watchdog"}
    sizes = {info.filename: info.file_size for info in zipfile.ZipFile(bundle.path).infolist()}
    assert {name: entry["bytes"] for name, entry in manifest["files"].items()} == \
        {name: size for name, size in sizes.items() if name != "manifest.json"}


def test_manifest_keeps_only_allowed_env_and_no_outside_paths(bundle, run_dir):
    text = (bundle.directory / "manifest.json").read_text()
    assert bundle.manifest["environment"] == {"OMP_NUM_THREADS": "2", "CHUNKSCOPE_MAX_PREFILL_TOKENS": "128",
                                              "CHUNKSCOPE_CACHE": "chunkscope"}
    for secret in ("hunter2", "AWS_SECRET", "secret-user", "/usr/bin", str(run_dir)):
        assert secret not in text
    assert not re.search(r"(?<![\w.~/-])/[A-Za-z]", text), "an absolute path survived"
    assert bundle.manifest["command_line"] == ("python -m engine serve --model qwen-small --run-dir . "
                                               "--workload trace:traces/azure.csv")
    assert bundle.manifest["workload"]["path"] == "traces/azure.csv"
    for name in ("summary.md",):
        assert "secret-user" not in (bundle.directory / name).read_text()
    run_row = _rows(bundle.db_path, "SELECT * FROM runs")[0]
    assert OUTSIDE_PATH not in json.dumps(run_row) and run_row["hostname"] is None


def test_trace_and_summary_cover_the_run(bundle):
    trace = json.loads(gzip.decompress(bundle.trace_path.read_bytes()))
    assert validate_trace(trace) == []
    summary = bundle.summary_md
    assert "## The run in numbers" in summary and "| requests | 10 |" in summary
    assert "| request | KV cache exhausted | 2 | 3, 6 |" in summary
    assert "| 25 | slice_budget | 64 | -1 | file | rejected | slice_budget must be >= 1 |" in summary
    assert summary.index("| 30 | 2 | 9 |") < summary.index("| 12 | 2 | 6 |")  # biggest preemption first


def test_time_window_shrinks_the_bundle(run_dir):
    steps = []     # each step reported as it starts (the Runs page's bar, the CLI's tqdm)
    full = export_bundle(run_dir / "telemetry.db", run_dir / "full.zip", run_id=2, progress=steps.append)
    assert tuple(steps) == EXPORT_STEPS
    part = export_bundle(run_dir / "telemetry.db", run_dir / "part.zip", run_id=2, since_s=0.1, until_s=0.2)
    assert part.num_bytes < full.num_bytes
    time_range = part.manifest["time_range"]
    assert (time_range["since_ns"], time_range["until_ns"], time_range["is_windowed"]) == (100 * MS, 200 * MS, True)
    assert 100 * MS <= time_range["first_ns"] and time_range["last_ns"] < 200 * MS
    assert part.manifest["counts"]["ticks"] == 10
    with open_bundle(run_dir / "part.zip") as opened:
        # Requests whose lifetime overlaps [100, 200) ms: arrivals at 80 (to 110), 120, 160 ms.
        assert [w["request_id"] for w in opened.workload] == [2, 3, 4]
        assert [c["tick"] for c in opened.lever_timeline["changes"]] == [10]


def test_export_refuses_unsafe_or_bad_requests(run_dir, tmp_path_factory):
    db = run_dir / "telemetry.db"
    export_bundle(db, run_dir / "b.zip")
    with pytest.raises(BundleError, match=r"already exists; choose another name, or replace it \(--force\)"):
        export_bundle(db, run_dir / "b.zip")
    assert export_bundle(db, run_dir / "b.zip", overwrite=True).num_bytes > 0
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    with pytest.raises(BundleError, match="output path .* is outside the allowed directory"):
        export_bundle(db, elsewhere / "b.zip", allowed_root=run_dir)
    with pytest.raises(BundleError, match="output path .* is outside the allowed directory"):
        export_bundle(db, run_dir / ".." / "escape.zip", allowed_root=run_dir)
    with pytest.raises(BundleError, match="telemetry db path .* is outside"):
        export_bundle(db, run_dir / "ok.zip", allowed_root=elsewhere)
    with pytest.raises(BundleError, match="no run 7 in"):
        export_bundle(db, run_dir / "c.zip", run_id=7)
    with pytest.raises(BundleError, match="time window is empty"):
        export_bundle(db, run_dir / "c.zip", since_s=2, until_s=1)
    with pytest.raises(BundleError, match="does not exist"):
        export_bundle(run_dir / "missing.db", run_dir / "c.zip")
    assert not (run_dir / "c.zip").exists() and not list(run_dir.glob(".c.zip.partial*"))


def _rewrite(src, dest, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            data = edit(name, data)
            if data is not None:
                zout.writestr(name, data)


def test_newer_schema_or_format_is_refused(run_dir):
    export_bundle(run_dir / "telemetry.db", run_dir / "b.zip")

    def bump(key, value):
        def edit(name, data):
            if name != "manifest.json":
                return data
            manifest = json.loads(data)
            manifest[key] = value
            return json.dumps(manifest).encode()
        return edit
    _rewrite(run_dir / "b.zip", run_dir / "new.zip", bump("schema_version", 3))
    with pytest.raises(BundleError, match=re.escape(f"bundle schema 3 is newer than this Chunkscope "
                                                    f"({ev.SCHEMA_VERSION}); upgrade to open it")):
        open_bundle(run_dir / "new.zip")
    _rewrite(run_dir / "b.zip", run_dir / "fmt.zip", bump("bundle_format", 9))
    with pytest.raises(BundleError, match=r"bundle format 9 is newer than this Chunkscope \(1\)"):
        open_bundle(run_dir / "fmt.zip")
    _rewrite(run_dir / "b.zip", run_dir / "str.zip", bump("schema_version", "one"))
    with pytest.raises(BundleError, match="'schema_version' must be a positive integer"):
        open_bundle(run_dir / "str.zip")


def test_corrupted_or_incomplete_bundles_are_refused(run_dir):
    good = run_dir / "b.zip"
    export_bundle(run_dir / "telemetry.db", good)
    raw = good.read_bytes()
    (run_dir / "cut.zip").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(BundleError, match="is not a zip file"):
        open_bundle(run_dir / "cut.zip")
    flipped = bytearray(raw)
    start = raw.index(b"workload.jsonl") + 40  # inside the first member's compressed data
    flipped[start:start + 64] = bytes(b ^ 0xFF for b in flipped[start:start + 64])
    (run_dir / "flip.zip").write_bytes(bytes(flipped))
    with pytest.raises(BundleError, match="is corrupted"):
        open_bundle(run_dir / "flip.zip")
    _rewrite(good, run_dir / "missing.zip", lambda name, data: None if name == "trace.json.gz" else data)
    with pytest.raises(BundleError, match="is missing trace.json.gz"):
        open_bundle(run_dir / "missing.zip")
    _rewrite(good, run_dir / "tamper.zip", lambda name, data: data + b"\n" if name == "workload.jsonl" else data)
    with pytest.raises(BundleError, match="workload.jsonl does not match the sha256"):
        open_bundle(run_dir / "tamper.zip")
    _rewrite(good, run_dir / "json.zip", lambda name, data: b"{not json" if name == "manifest.json" else data)
    with pytest.raises(BundleError, match="manifest.json is not valid JSON"):
        open_bundle(run_dir / "json.zip")
    (run_dir / "text.zip").write_text("hello")
    with pytest.raises(BundleError, match="is not a zip file"):
        open_bundle(run_dir / "text.zip")
    with pytest.raises(BundleError, match="does not exist"):
        open_bundle(run_dir / "nope.zip")


def test_bundle_close_removes_the_extracted_files(run_dir):
    export_bundle(run_dir / "telemetry.db", run_dir / "b.zip")
    opened = open_bundle(run_dir / "b.zip")
    assert opened.db_path.is_file()
    opened.close()
    assert not opened.directory.exists()


def test_export_cli(run_dir, capsys):
    out = run_dir / "cli.zip"
    assert telemetry_main(["export", "--db", str(run_dir / "telemetry.db"), "-o", str(out)]) == 0
    assert "run 2, 10 requests, 40 ticks" in capsys.readouterr().out
    assert telemetry_main(["export", "--db", str(run_dir / "telemetry.db"), "-o", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert telemetry_main(["export", "--db", str(run_dir / "telemetry.db"), "-o", str(out), "--force",
                           "--run", "1", "--until-s", "0.5"]) == 0
    with open_bundle(out) as opened:
        assert opened.run_id == 1 and opened.manifest["time_range"]["until_ns"] == 500 * MS


def test_a_secret_variable_is_named_in_the_manifest_never_its_value(tmp_path):
    from telemetry.manifest import REDACTED, allowed_environment

    env = {"CHUNKSCOPE_API_KEY": "s3cret", "CHUNKSCOPE_HF_TOKEN": "t0k", "CHUNKSCOPE_MAX_PREFILL_TOKENS": "128",
           "CHUNKSCOPE_DB_PASSWORD": "pw", "HOME": "/root"}
    assert allowed_environment(env, tmp_path) == {
        "CHUNKSCOPE_API_KEY": REDACTED, "CHUNKSCOPE_DB_PASSWORD": REDACTED, "CHUNKSCOPE_HF_TOKEN": REDACTED,
        "CHUNKSCOPE_MAX_PREFILL_TOKENS": "128"}
