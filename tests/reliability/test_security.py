"""Security claims: loopback-only dashboard, parameterized SQL, a capped strict levers file, clean exports."""
from __future__ import annotations

import ast
import gzip
import re
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from reliability_helpers import REPO

from telemetry import events as ev
from telemetry.levers import MAX_FILE_BYTES, LeversError, validate_file_bytes

SQL_WORDS = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE|DROP|PRAGMA|WHERE|FROM|VALUES)\b")

# Every interpolation into SQL text, vetted: (file, expression) -> why it cannot carry user data.
# A new f-string in SQL fails the scan until it is reviewed and listed here. Safe by construction,
# and so not listed: int(...), placeholders(...) ('?' marks only), module-level string literals.
VETTED = {
    ("dashboard/queries/db.py", "values_cte"): "percentile_sql() wraps a constant SELECT from the query modules",
    ("dashboard/queries/chunks.py", "where"): "ChunkFilter.where(): constant clauses, values bound as ?",
    ("dashboard/queries/chunks.py", "cols"): "join of the module's constant column tuple",
    ("dashboard/queries/live.py", "'+' if is_recent else ''"): "an index hint, '+' or ''",
    ("dashboard/queries/live.py", "itl_filter"): "constant 'AND id > ?' or 'AND request_id IN (SAMPLED_IDS)', "
                                                 "values bound",
    ("dashboard/queries/live.py", "request_filter"): "constant 'AND request_id > ?' or 'AND request_id IN "
                                                     "(SAMPLED_IDS)', values bound",
    ("dashboard/queries/requests.py", "cols"): "join of REQUEST_COLUMNS (constant)",
    ("dashboard/queries/requests.py", "' AND '.join(clauses)"): "constant clauses, values bound as ?",
    ("dashboard/queries/runs.py", "', '.join(RUN_COLUMNS)"): "constant column tuple",
    ("dashboard/queries/runs.py", "table"): "_run_rows() is called with literal table names",
    ("dashboard/queries/runs.py", "where"): "_run_rows(): constant clause, values bound as ?",
    ("telemetry/bundle_export.py", "', '.join(_RUN_TEXT_COLUMNS)"): "constant column tuple",
    ("telemetry/bundle_export.py", "', '.join((f'{c} = ?' for c in _RUN_TEXT_COLUMNS))"): "constant columns",
    ("telemetry/reader.py", "table"): "checked against TAILABLE_TABLES just above",
    ("telemetry/schema.py", "verb"): "INSERT or INSERT OR REPLACE, from the codec",
    ("telemetry/schema.py", "cls.TABLE"): "the event class's table constant",
    ("telemetry/schema.py", "', '.join((f'[{c}]' for c in columns))"): "dataclass field names",
    ("telemetry/schema.py", "', '.join(('?' for _ in columns))"): "'?' marks",
    ("telemetry/snapshot.py", "table"): "loops over EVENT_TABLES / ev.TABLES / schema.INDEXES constants",
    ("telemetry/snapshot.py", "name"): "index names read from sqlite_master of the snapshot itself",
    ("telemetry/snapshot.py", "parts"): "UNION of constant SELECTs over EVENT_TABLES",
    ("telemetry/snapshot.py", "'_'.join(columns)"): "schema.INDEXES constant",
    ("telemetry/snapshot.py", "', '.join((f'[{c}]' for c in columns))"): "schema.INDEXES constant",
    ("telemetry/wal_checkpoint.py", "mode"): "PASSIVE or TRUNCATE, chosen in WalCheckpointer.run",
    ("telemetry/run_totals.py", "_STORED_COLUMNS"): "join of REQUEST_COLUMNS (constant)",
    ("telemetry/run_totals.py", "marks"): "'?' marks only, one per bound request id",
    ("telemetry/store_writes.py", "run_totals.UPDATE_SET"): "'col = col + ?' over the TOTALS column constants",
    ("telemetry/run_totals.py", "names"): "'col = ?' over the TOTALS column constants",
    ("telemetry/run_totals.py", "aggregates"): "the TOTALS aggregate constants",
    ("telemetry/run_totals.py", "table"): "the TOTALS table-name constants",
    ("telemetry/run_totals.py", "columns"): "the TOTALS column constants",
    ("telemetry/run_totals.py", "', '.join(parts)"): "constant subqueries built from TOTALS",
}


def _literal_text(node: ast.AST) -> str:
    return "".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _constant_strings(tree: ast.Module) -> set[str]:
    """Module-level names bound once to a plain string literal (safe to interpolate)."""
    bound: dict[str, list[ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bound.setdefault(target.id, []).append(node.value)
    return {name for name, values in bound.items()
            if len(values) == 1 and isinstance(values[0], ast.Constant) and isinstance(values[0].value, str)}


def _is_safe_by_construction(expr: ast.AST, constants: set[str]) -> bool:
    """int(...), placeholders(...) (only '?' marks) and module string constants."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("int", "placeholders"):
        return True
    return isinstance(expr, ast.Name) and expr.id in constants


def sql_interpolations() -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """(f-string interpolations into SQL text, %/+/.format() SQL building) in telemetry/ and dashboard/."""
    interpolations, formatting = [], []
    for path in sorted([*REPO.glob("telemetry/*.py"), *REPO.glob("dashboard/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text())
        constants = _constant_strings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) and SQL_WORDS.search(_literal_text(node)):
                for value in node.values:
                    if isinstance(value, ast.FormattedValue) and not _is_safe_by_construction(value.value, constants):
                        interpolations.append((rel, node.lineno, ast.unparse(value.value)))
            elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
                  and isinstance(node.left, ast.Constant) and SQL_WORDS.search(_literal_text(node.left))):
                formatting.append((rel, node.lineno, ast.unparse(node)))
            elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                  and SQL_WORDS.search(_literal_text(node))
                  and not all(isinstance(side, (ast.Constant, ast.JoinedStr)) for side in (node.left, node.right))):
                formatting.append((rel, node.lineno, ast.unparse(node)))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
                  and SQL_WORDS.search(_literal_text(node.func.value))):
                formatting.append((rel, node.lineno, ast.unparse(node)))
    return interpolations, formatting


def test_every_sql_statement_is_parameterized():
    interpolations, formatting = sql_interpolations()
    assert interpolations, "the scan must see the known, vetted interpolations (is it still scanning?)"
    assert not formatting, f"SQL built with % / + / .format(): {formatting}"
    unvetted = [(f, line, expr) for f, line, expr in interpolations if (f, expr) not in VETTED]
    assert not unvetted, f"unreviewed interpolation into SQL (bind it as ?, or vet it in VETTED): {unvetted}"


def test_the_scan_catches_an_injection():
    tree = ast.parse('conn.execute(f"SELECT * FROM runs WHERE model = \'{name}\'")\n'
                     'conn.execute("DELETE FROM runs WHERE run_id = %s" % run_id)')
    found = [n for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) and SQL_WORDS.search(_literal_text(n))]
    assert [ast.unparse(v.value) for v in found[0].values if isinstance(v, ast.FormattedValue)] == ["name"]
    assert any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(tree))
    module = ast.parse('SAFE = "run_id = ?"\nUNSAFE = input()\n')
    constants = _constant_strings(module)
    assert constants == {"SAFE"}
    assert not _is_safe_by_construction(ast.parse("name").body[0].value, constants)
    assert not _is_safe_by_construction(ast.parse("UNSAFE").body[0].value, constants)
    assert _is_safe_by_construction(ast.parse("placeholders(ids)").body[0].value, constants)


def test_dashboard_config_binds_loopback_only():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"
    assert config["browser"]["gatherUsageStats"] is False


@pytest.mark.parametrize("body,words", [
    (b" " * (MAX_FILE_BYTES + 1), "limit"),
    (b'{"version": 1, "levers": {"slice_budget": 1e999}}', "slice_budget"),
    (b'{"version": 1, "levers": {"kv_blocks_cap": NaN}}', "NaN"),
    (b'{"version": 1, "levers": {"__class__": 1}}', "unknown lever"),
    (b'{"version": 1, "levers": {"max_prefill_tokens": 4096}, "exec": "rm -rf /"}', "unknown top-level"),
    (b'{"version": 1, "version": 2, "levers": {}}', "duplicate"),
    (b'{"version": 1, "levers": {"speculation": "../../etc/passwd"}}', "not one of"),
    (b'{"version": 1, "levers": {"bisect_no_mix": 1}}', "expected bool"),
])
def test_levers_file_is_size_capped_and_schema_checked(body, words):
    with pytest.raises(LeversError, match=re.escape(words)):
        validate_file_bytes(body)


def _small_run(run_dir: Path, tiny_model) -> Path:
    from engine.model.runner import ModelRunner
    from engine.scheduler.loop import Scheduler
    from telemetry.levers import defaults
    from telemetry.writer import TelemetryWriter
    db = run_dir / "telemetry.db"
    with TelemetryWriter(db) as writer:
        writer.start_run(ev.RunStarted(started_at=time.time(), model="tiny", device="cpu", config={},
                                       model_config={}, versions={}, workload={"kind": "test"},
                                       levers=defaults().as_dict(), command_line=f"python -m engine serve "
                                       f"--run-dir {run_dir}"))
        sched = Scheduler(ModelRunner.build(tiny_model, num_kv_blocks=16, num_ssm_slots=4), defaults(), emit=writer.emit)
        for i in range(4):
            sched.submit(i, [3, 4, 5 + i], {"max_tokens": 3})
        while sched.has_work:
            sched.step()
    return db


def test_export_carries_no_secrets_and_stays_in_the_run_dir(tmp_path, tiny_model, monkeypatch):
    bundle_export = pytest.importorskip("telemetry.bundle_export")
    secret = "sekrit-" + "7f3a9c0e51"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", secret + "-hf")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = _small_run(run_dir, tiny_model)
    out = run_dir / "bundle.zip"
    bundle_export.export_bundle(db, out, allowed_root=run_dir)
    with zipfile.ZipFile(out) as archive:
        for name in archive.namelist():
            data = archive.read(name)
            if name.endswith(".gz"):
                data = gzip.decompress(data)
            assert secret.encode() not in data, f"{name} carries an environment secret"
            assert str(tmp_path).encode() not in data, f"{name} carries an absolute local path"
    with pytest.raises(bundle_export.BundleError, match="outside the allowed directory"):
        bundle_export.export_bundle(db, tmp_path / "elsewhere.zip", allowed_root=run_dir)
    with pytest.raises(bundle_export.BundleError, match="outside the allowed directory"):
        bundle_export.export_bundle(db, run_dir / ".." / "escape.zip", allowed_root=run_dir)
