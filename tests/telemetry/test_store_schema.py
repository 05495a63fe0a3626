import sqlite3

import sqlite_utils

from telemetry import events as ev
from telemetry import schema
from telemetry.writer import TelemetryWriter

from telemetry_factories import make_run_started, one_of_each


def _tables_and_indexes(db):
    return sorted(db.execute("SELECT type, name, sql FROM sqlite_master").fetchall(), key=str)


def test_migrations_twice_are_harmless(db_path):
    db = sqlite_utils.Database(db_path)
    schema.ensure_schema(db)
    db["ticks"].insert({"run_id": 1, "tick": 5, "t_ns": 10})
    before = _tables_and_indexes(db)
    applied = db.execute("SELECT count(*) FROM _sqlite_migrations").fetchone()[0]
    schema.ensure_schema(db)
    assert _tables_and_indexes(db) == before
    assert db.execute("SELECT count(*) FROM _sqlite_migrations").fetchone()[0] == applied
    assert db.execute("SELECT tick FROM ticks").fetchall() == [(5,)]


def test_every_contract_table_exists_with_its_fields(db_path):
    db = sqlite_utils.Database(db_path)
    schema.ensure_schema(db)
    for cls in ev.EVENT_TYPES:
        columns = set(db[cls.TABLE].columns_dict)
        assert {"run_id", *schema.field_hints(cls)} <= columns, cls.TABLE
    assert db["requests"].pks == ["run_id", "request_id"]
    assert db["ticks"].pks == ["id"]
    assert db["runs"].pks == ["run_id"]
    assert {"schema_version", "pid", "writer_wait_ns", "num_dropped"} <= set(db["runs"].columns_dict)


def test_indexes_serve_dashboard_queries(db_path):
    db = sqlite_utils.Database(db_path)
    schema.ensure_schema(db)
    plan = db.execute("EXPLAIN QUERY PLAN SELECT * FROM ticks WHERE run_id = 1 AND tick > 10").fetchall()
    assert "idx_ticks_run_id_tick" in str(plan)
    plan = db.execute("EXPLAIN QUERY PLAN SELECT * FROM chunks WHERE run_id = 1 AND request_id = 3").fetchall()
    assert "idx_chunks_run_id_request_id" in str(plan)


def test_added_field_becomes_column(db_path):
    db = sqlite_utils.Database(db_path)
    schema.ensure_schema(db)
    db.execute("CREATE TABLE old_ticks AS SELECT * FROM ticks")  # nothing lost by the additive step
    db["ticks"].transform(drop={"num_finished"})
    assert "num_finished" not in db["ticks"].columns_dict
    schema.ensure_schema(db)
    assert "num_finished" in db["ticks"].columns_dict


def test_round_trip_of_every_event_kind(db_path):
    originals = one_of_each()
    assert {type(e) for e in originals} == set(ev.EVENT_TYPES)
    with TelemetryWriter(db_path) as writer:
        run_id = writer.start_run(make_run_started())
        for event in originals:
            writer.emit(event)
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    for original in originals:
        rows = conn.execute(f"SELECT * FROM [{original.TABLE}] WHERE run_id = ?", [run_id]).fetchall()
        assert len(rows) == 1, original.TABLE
        assert schema.decode_row(type(original), dict(rows[0])) == original
    run = dict(conn.execute("SELECT * FROM runs").fetchone())
    assert run["schema_version"] == ev.SCHEMA_VERSION
    assert run["status"] == "finished" and run["finished_at"] >= run["started_at"]
    assert schema.decode_row(ev.RunStarted, run) == make_run_started(started_at=run["started_at"],
                                                                      status="finished")


def test_lever_change_keeps_value_types(db_path):
    values = [True, 0, "mtp", None, 1.5]
    with TelemetryWriter(db_path) as writer:
        writer.start_run(make_run_started())
        for i, value in enumerate(values):
            writer.emit(ev.LeverChange(tick=i, t_ns=i, name="x", old=None, new=value))
    conn = sqlite3.connect(db_path)
    conn.row_factory = sqlite3.Row
    back = [schema.decode_row(ev.LeverChange, dict(r)).new for r in conn.execute("SELECT * FROM lever_changes ORDER BY id")]
    assert back == values and type(back[0]) is bool and type(back[1]) is int
