"""One convention across both CLIs (issue 29, item 14): every option says what it does, a run
directory is ``--run-dir DIR`` wherever a command reads one, ``levers get`` says where it read from,
and ``runs`` cuts nothing."""
from __future__ import annotations

import argparse
import json
import sqlite3

import pytest

import telemetry.__main__ as telemetry_cli
from engine.cli import generate, replay, serve
from telemetry.__main__ import main as telemetry_main


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine")
    subparsers = parser.add_subparsers()
    for command in (generate, serve, replay):
        command.add_parser(subparsers)
    return parser


def _commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(command path, its parser) for every leaf command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix.strip(), parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _commands(child, f"{prefix} {name}")


ALL = [(f"telemetry {name}", p) for name, p in _commands(telemetry_cli.build_parser())] + \
      [(f"engine {name}", p) for name, p in _commands(_engine_parser())]


@pytest.mark.parametrize("name, parser", ALL, ids=[n for n, _ in ALL])
def test_every_option_and_argument_has_help(name, parser):
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())]
    assert not missing, f"python -m {name}: no help text for {missing}"


@pytest.mark.parametrize("name", ["telemetry runs", "telemetry summary", "telemetry tail", "telemetry export",
                                  "telemetry levers get", "telemetry levers set", "telemetry levers validate",
                                  "engine serve", "engine replay"])
def test_a_run_directory_is_run_dir_everywhere(name):
    parser = dict(ALL)[name]
    assert "--run-dir" in {s for a in parser._actions for s in a.option_strings}, f"python -m {name} lacks --run-dir"


def _store(tmp_path):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dashboard"))
    import synthetic_run
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    synthetic_run.write_run(run_dir / "telemetry.db", synthetic_run.SimConfig(num_requests=3), status="finished")
    return run_dir


def test_run_dir_and_db_read_the_same_store_and_runs_cuts_nothing(tmp_path, capsys):
    run_dir = _store(tmp_path)
    device = "cpu (Intel(R) Xeon(R) Platinum 8480+ with a long name, 2 threads)"
    conn = sqlite3.connect(run_dir / "telemetry.db")
    conn.execute("UPDATE runs SET device = ?", [device])
    conn.commit()
    conn.close()
    outs = []
    for where in (["--run-dir", str(run_dir)], ["--db", str(run_dir / "telemetry.db")]):
        assert telemetry_main(["runs", *where]) == 0
        outs.append(capsys.readouterr().out)
        assert telemetry_main(["summary", *where, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[2] and outs[1] == outs[3] and device in outs[0]
    out = tmp_path / "b.zip"
    assert telemetry_main(["export", "--run-dir", str(run_dir), "-o", str(out)]) == 0 and out.stat().st_size > 0
    with pytest.raises(SystemExit):                       # one of the two, not both
        telemetry_main(["runs", "--run-dir", str(run_dir), "--db", str(run_dir / "telemetry.db")])


def test_levers_get_says_where_it_read_from(tmp_path, capsys, monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("CHUNKSCOPE_")]:
        monkeypatch.delenv(name)
    assert telemetry_main(["levers", "get"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("read from: defaults\n") and "no levers file given" in out
    monkeypatch.setenv("CHUNKSCOPE_SLICE_BUDGET", "32")
    assert telemetry_main(["levers", "set", "bisect_no_mix", "true", "--run-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert telemetry_main(["levers", "get", "--run-dir", str(tmp_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["read_from"] == f"defaults < environment (CHUNKSCOPE_SLICE_BUDGET) < {tmp_path / 'levers.json'} (version 1)"
    assert got["levers"]["bisect_no_mix"] is True and got["levers"]["slice_budget"] == 32
    assert telemetry_main(["levers", "validate", "--run-dir", str(tmp_path)]) == 0
    assert telemetry_main(["levers", "get", "--run-dir", str(tmp_path / "none")]) == 0
    assert "no file at" in capsys.readouterr().out
