"""The 0004_kv_quant migration: a store written before InnerQ gets the new columns, old rows read NULL."""
import sqlite_utils

from telemetry import events as ev
from telemetry.schema import ADDED_COLUMNS, columns_for, ensure_schema


def test_an_older_store_gains_the_kv_quant_columns(tmp_path):
    db = sqlite_utils.Database(tmp_path / "old.db")
    added = ADDED_COLUMNS["0004_kv_quant"]
    for cls in (ev.ChunkDecision, ev.Tick):   # the tables as they were before the migration
        old = {k: v for k, v in columns_for(cls).items() if k not in added[cls.TABLE]}
        db[cls.TABLE].create({"id": int, "run_id": int, **old}, pk="id")
    db["chunks"].insert({"run_id": 1, "tick": 0, "t_ns": 0, "request_id": 3})
    ensure_schema(db)
    ensure_schema(db)  # idempotent
    assert set(added["chunks"]) <= set(db["chunks"].columns_dict)
    assert set(added["ticks"]) <= set(db["ticks"].columns_dict)
    assert list(db.query("SELECT request_id, kv_quant_state FROM chunks")) == [{"request_id": 3, "kv_quant_state": None}]
    assert "0004_kv_quant" in {r["name"] for r in db["_sqlite_migrations"].rows}
