"""SQLite schema for the telemetry store, derived from the event dataclasses.

One table per event class (``events.py`` is the contract): columns are the
dataclass fields, plus ``run_id`` and an ``id`` INTEGER PRIMARY KEY (a rowid
alias: rows are never deleted, so ids only grow and "tail after an id" is a
primary-key range scan). ``requests`` is the exception: its key is
(run_id, request_id) and its rows are replaced as a request moves.
Dict, list and ``Any`` fields are stored as JSON text; bools as 0/1.

Built with sqlite-utils ``Migrations``: one migration per table and one for the
indexes, so ``ensure_schema`` is idempotent. Fields added to ``events.py``
later become columns through ``_add_missing_columns`` (additive only).
"""
from __future__ import annotations

import dataclasses
import json
import operator
import types
import typing
from typing import Any, Callable

import sqlite_utils
from sqlite_utils.migrations import Migrations

from telemetry import events as ev
from telemetry import run_totals
from telemetry.events import SCHEMA_VERSION  # noqa: F401  (re-exported)

RUNS_TABLE = "runs"
REQUESTS_TABLE = "requests"

# Columns of ``runs`` that are not RunStarted fields: written by the writer.
RUN_EXTRA_COLUMNS: dict[str, type] = {
    "pid": int,                 # process that owns the run (crash detection)
    "hostname": str,
    "finished_at": float,       # wall clock, unix seconds
    "writer_wait_ns": int,      # total time producers blocked on a full queue
    "num_events": int,          # rows committed by the writer
    "num_dropped": int,         # rows dropped while the store was failing
    "writer_error": str,        # last store error seen by the writer, if any
    # whole-run totals maintained by the writer per batch (telemetry/run_totals.py)
    **{name: int for name in run_totals.COLUMNS},
}

# Indexes per table, chosen for the dashboard's queries. Each index costs
# insert throughput, so the high-volume ``tokens`` table gets only the one its
# ITL window query needs; tails read by ``id`` (the primary key).
INDEXES: dict[str, list[tuple[str, ...]]] = {
    "ticks": [("run_id", "tick"), ("run_id", "t_ns")],
    "chunks": [("run_id", "tick"), ("run_id", "t_ns"), ("run_id", "request_id")],
    "stream_events": [("run_id", "tick")],
    "preemptions": [("run_id", "tick")],
    "requests": [("run_id", "status")],
    "request_events": [("run_id", "request_id"), ("run_id", "tick")],
    "tokens": [("run_id", "request_id", "index")],
    "lever_changes": [("run_id", "tick"), ("run_id", "name")],
    "events": [("run_id", "tick"), ("run_id", "kind")],
}

EVENT_CLASSES: dict[str, type] = {cls.TABLE: cls for cls in ev.EVENT_TYPES}


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int; anything else unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _column_type(hint: Any) -> type:
    """Map a field annotation to the SQLite column type sqlite-utils understands."""
    base = _base_type(hint)
    if base in (bool, int):
        return int
    if base in (float, str):
        return base
    return str  # dict / list / Any: JSON text


def is_json_field(hint: Any) -> bool:
    return _base_type(hint) not in (bool, int, float, str)


def _is_bool_field(hint: Any) -> bool:
    return _base_type(hint) is bool


def field_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in declaration order (ClassVars excluded)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def columns_for(cls: type) -> dict[str, type]:
    return {name: _column_type(hint) for name, hint in field_hints(cls).items()}


def _to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


@dataclasses.dataclass(frozen=True)
class RowCodec:
    """Turns events of one class into insert tuples (writer thread) and rows back into events."""

    cls: type
    table: str
    columns: tuple[str, ...]           # insert column order, starting with run_id
    encode: Callable[[int, Any], tuple]
    insert_sql: str                    # prepared once; requests use INSERT OR REPLACE

    def decode(self, row: dict[str, Any]) -> Any:
        """Rebuild the dataclass from a stored row (JSON and bools restored)."""
        return decode_row(self.cls, row)


def _make_encoder(cls: type) -> Callable[[int, Any], tuple]:
    hints = field_hints(cls)
    names = list(hints)
    get_all = operator.attrgetter(*names)
    json_positions = [i for i, name in enumerate(names) if is_json_field(hints[name])]
    if not json_positions:
        def encode(run_id: int, event: Any) -> tuple:
            return (run_id, *get_all(event))
        return encode

    def encode_json(run_id: int, event: Any) -> tuple:
        values = list(get_all(event))
        for i in json_positions:
            values[i] = _to_json(values[i])
        return (run_id, *values)
    return encode_json


_CODECS: dict[type, RowCodec] = {}


def codec_for(cls: type) -> RowCodec:
    codec = _CODECS.get(cls)
    if codec is None:
        columns = ("run_id", *field_hints(cls))
        verb = "INSERT OR REPLACE" if cls.TABLE == REQUESTS_TABLE else "INSERT"
        sql = (f"{verb} INTO [{cls.TABLE}] ({', '.join(f'[{c}]' for c in columns)}) "
               f"VALUES ({', '.join('?' for _ in columns)})")
        codec = RowCodec(cls, cls.TABLE, columns, _make_encoder(cls), sql)
        _CODECS[cls] = codec
    return codec


def json_value(value: Any) -> Any:
    """A JSON-text column (lever_changes.old / new, ...) read back as its value; other text as is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def decode_row(cls: type, row: dict[str, Any]) -> Any:
    """Stored row -> dataclass instance; unknown columns (run_id, id) are ignored."""
    values: dict[str, Any] = {}
    for name, hint in field_hints(cls).items():
        if name not in row:
            continue
        value = row[name]
        if value is not None and is_json_field(hint) and isinstance(value, str):
            value = json.loads(value)
        elif value is not None and _is_bool_field(hint):
            value = bool(value)
        values[name] = value
    return cls(**values)


def run_row(started: ev.RunStarted) -> dict[str, Any]:
    """RunStarted -> ``runs`` row (JSON for dict fields)."""
    hints = field_hints(ev.RunStarted)
    return {name: (_to_json(getattr(started, name)) if is_json_field(hint) else getattr(started, name))
            for name, hint in hints.items()}


# ---- migrations -------------------------------------------------------------

migrations = Migrations("chunkscope_telemetry")


@migrations(name="0001_runs")
def _create_runs(db: sqlite_utils.Database) -> None:
    db[RUNS_TABLE].create({"run_id": int, **columns_for(ev.RunStarted), **RUN_EXTRA_COLUMNS},
                          pk="run_id", if_not_exists=True,
                          defaults={"writer_wait_ns": 0, "num_events": 0, "num_dropped": 0})


def _table_migration(cls: type) -> None:
    def create(db: sqlite_utils.Database) -> None:
        columns = {"id": int, "run_id": int, **columns_for(cls)} if cls.TABLE != REQUESTS_TABLE \
            else {"run_id": int, **columns_for(cls)}
        pk: Any = ("run_id", "request_id") if cls.TABLE == REQUESTS_TABLE else "id"
        db[cls.TABLE].create(columns, pk=pk, if_not_exists=True, not_null={"run_id"})
    create.__name__ = f"create_{cls.TABLE}"
    migrations(name=f"0002_{cls.TABLE}")(create)


for _cls in ev.EVENT_TYPES:
    _table_migration(_cls)


@migrations(name="0003_indexes")
def _create_indexes(db: sqlite_utils.Database) -> None:
    for table, indexes in INDEXES.items():
        for columns in indexes:
            db[table].create_index(list(columns), if_not_exists=True,
                                   index_name=f"idx_{table}_{'_'.join(columns)}")


# Columns added after the first schema, by the migration that added them. A store created since
# has them from its CREATE TABLE; an older store gets them here (nullable: old rows read NULL).
ADDED_COLUMNS: dict[str, dict[str, dict[str, type]]] = {
    # InnerQ: the calibration state each chunk saw; KV bytes per tick (the byte-budgeted cache).
    "0004_kv_quant": {"chunks": {"kv_quant_state": str},
                      "ticks": {"kv_bytes_used": int, "kv_bytes_total": int, "kv_tokens_used": int,
                                "kv_tokens_total": int}},
    # MLA: a whole-prompt chunk that ran past the slice budget (the reference's rule, issue 27).
    "0005_mla_whole_prompt": {"chunks": {"slice_budget_ignored": int}},
    # Vision (issue 28): the image rows a chunk covered and the tower's time; images per request.
    "0006_vision": {"chunks": {"image_spans": str, "encoder_ns": int, "ep_vision_sync_ns": int},
                    "requests": {"num_images": int}},
}


def _added_columns_migration(name: str, tables: dict[str, dict[str, type]]) -> None:
    def add(db: sqlite_utils.Database) -> None:
        for table, columns in tables.items():
            existing = set(db[table].columns_dict)
            for column, col_type in columns.items():
                if column not in existing:
                    db[table].add_column(column, col_type)
    add.__name__ = f"add_{name}"
    migrations(name=name)(add)


for _name, _tables in ADDED_COLUMNS.items():
    _added_columns_migration(_name, _tables)


def _add_missing_columns(db: sqlite_utils.Database) -> None:
    """Additive evolution: a field added to events.py becomes a nullable column."""
    wanted = {RUNS_TABLE: {**columns_for(ev.RunStarted), **RUN_EXTRA_COLUMNS}}
    wanted.update({cls.TABLE: columns_for(cls) for cls in ev.EVENT_TYPES})
    for table, columns in wanted.items():
        existing = set(db[table].columns_dict)
        for name, col_type in columns.items():
            if name not in existing:
                db[table].add_column(name, col_type)


def configure_connection(db: sqlite_utils.Database, *, busy_timeout_ms: int = 5000) -> None:
    """Pragmas for the single write connection: WAL lets readers poll while we write."""
    db.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")


def ensure_schema(db: sqlite_utils.Database) -> None:
    """Apply pending migrations; harmless to run any number of times."""
    migrations.apply(db)
    _add_missing_columns(db)
