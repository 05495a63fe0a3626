"""Issue 29 without a browser: the decisions behind the newcomer fixes (the browser test drives the pages).

Carried-over levers and the reset (item 9), the bundle window's negatives (item 9), whole short tables and
the sideways-scroll hint (item 5), counting words (item 12), the crash banner and the restart form's
settings (item 1), and a SIGKILLed engine counted dead before its parent reaps it (item 1)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dashboard import bundles, engine_control, lever_state
from dashboard.panels import engine_process, tables
from dashboard.engine_api_options import ApiOptionError, ApiOptions
from dashboard.paths import RunPaths
from dashboard.words import ordinal, plural
from telemetry.levers import LEVERS, defaults
from telemetry.procs import is_pid_alive, is_zombie


def _rows(changes: list[dict], pending=lever_state.PendingFile(None, {}, {}, None)) -> list[lever_state.LeverRow]:
    columns = ["name", "status", "new", "tick", "source", "reason", "file_version", "id"]
    frame = pd.DataFrame([{c: r.get(c) for c in columns} for r in changes], columns=columns)
    return lever_state.lever_rows(pending, frame, {})


def test_levers_the_run_took_from_the_file_at_its_start_are_carried_over():
    start = {"status": "applied", "tick": 0, "source": "file", "file_version": 3}
    rows = _rows([{**start, "name": "slice_budget", "new": "32", "id": 1},
                  {**start, "name": "max_prefill_tokens", "new": "256", "id": 2},       # its default
                  {**start, "name": "bisect_no_mix", "new": "true", "id": 3, "source": "env"},
                  {"name": "always_mixed", "status": "applied", "new": "true", "tick": 40, "source": "file",
                   "file_version": 4, "id": 4}])
    assert lever_state.carried_over(rows) == {"slice_budget": 32}
    # changed since (the newest application per lever is what lever_state.latest_changes gives)
    changed_since = _rows([{"name": "slice_budget", "status": "applied", "new": "16", "tick": 9, "source": "file",
                            "file_version": 4, "id": 2}])
    assert lever_state.carried_over(changed_since) == {}


def test_a_callback_with_the_drawn_value_or_the_files_request_is_no_change():
    """Issue 29, item 11: a redrawn widget's callback must not write (it wrote every lever, one version
    each, and the toast named the last)."""
    pending = lever_state.PendingFile(4, {"bisect_no_mix": True}, {}, None)
    assert not lever_state.is_change("slice_budget", 64, 64, pending)            # the value it was drawn with
    assert not lever_state.is_change("bisect_no_mix", True, False, pending)      # the file asks for it already
    assert lever_state.is_change("bisect_no_mix", False, True, pending)          # a toggle back
    assert lever_state.is_change("slice_budget", 32, 64, pending)


def test_reset_writes_every_default_above_every_version_seen(tmp_path):
    path = tmp_path / "levers.json"
    lever_state.write_change(path, "slice_budget", 32)
    assert lever_state.reset_to_defaults(path, telemetry_version=6) == 7
    written = json.loads(path.read_text())
    assert written["version"] == 7 and written["levers"] == defaults().as_dict()
    assert set(written["levers"]) == {lever.name for lever in LEVERS}


@pytest.mark.parametrize("since, until, problem", [
    (-5.0, None, "from s must be 0 or more"), (None, -0.5, "until s must be 0 or more"),
    (float("nan"), None, "from s must be 0 or more"), (10.0, 10.0, "must be after since"),
    (0.0, None, None), (None, None, None), (2.0, 3.5, None)])
def test_the_bundle_window_takes_no_negative_second(since, until, problem):
    found = bundles.window_problem(since, until)
    assert (found is None) if problem is None else (problem in found)


def test_short_tables_show_every_row_and_wide_ones_name_what_a_1280_px_window_hides():
    assert tables.full_height(len(LEVERS)) == tables.ROW_PX * (len(LEVERS) + 1) + 3
    assert tables.full_height(tables.ALL_ROWS_UP_TO + 1) is None
    frame = pd.DataFrame({"a": ["x" * 40], "b": ["y" * 40], "c": [1], "long_named_column": [2]})
    widths = tables.column_widths(frame)
    budget = widths["a"]["width"] + widths["b"]["width"]
    assert tables.columns_past(widths, list(frame.columns), budget) == ["c", "long_named_column"]
    assert tables.columns_past(widths, list(frame.columns), 10_000) == []


def test_counting_words():
    assert [plural(n, "request") for n in (0, 1, 2)] == ["0 requests", "1 request", "2 requests"]
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == \
        ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]


def test_the_restart_form_starts_what_the_crashed_run_ran_where_it_can():
    def settings(run):
        found = engine_process.restart_settings(run)
        return found.model, found.workload, found.rate, found.api.port, found.api.host

    assert settings({"model": "tiny", "workload": {"kind": "multiturn", "rate": 8}}) == \
        ("tiny", "multiturn", 8.0, "", "127.0.0.1")
    assert settings({"model": "my-ckpt", "workload": {"kind": "replay", "rate": 1e9}}) == \
        ("tiny", "synthetic", 4.0, "", "127.0.0.1")
    assert settings({}) == ("tiny", "synthetic", 4.0, "", "127.0.0.1")
    # what ./run.sh starts restarts as itself, its API included
    run_sh = ("python -m engine serve --model tiny-chat --run-dir runs/default --workload chat --rate 4 "
              "--api-port 8000 --api-host 127.0.0.1")
    assert settings({"model": "tiny-chat", "workload": {"kind": "chat", "rate": 4}, "command_line": run_sh}) == \
        ("tiny-chat", "chat", 4.0, "8000", "127.0.0.1")
    assert settings({"command_line": "serve --api-port=0009001 --api-host=::1"})[3:] == ("9001", "::1")
    assert settings({"command_line": "serve --run-dir /tmp/it's --api-port 7"})[3:] == ("7", "127.0.0.1")


def test_the_api_options_carry_over_and_a_bad_port_host_or_missing_key_is_refused():
    recorded = ApiOptions.from_command_line("python -m engine serve --run-dir r --api-port 8000 --api-host 0.0.0.0 "
                                            "--max-waiting 9 --no-api-process --api-key <redacted>")
    assert recorded == ApiOptions("8000", "0.0.0.0", "9", separate_process=False, needs_key=True)
    argv, env = recorded.argv_and_env(" 8000 ", key="s3cret")
    assert argv == ["--api-port", "8000", "--api-host", "0.0.0.0", "--max-waiting", "9", "--no-api-process"]
    assert env == {"CHUNKSCOPE_API_KEY": "s3cret"} and "s3cret" not in argv   # the key never on a command line
    with pytest.raises(ApiOptionError, match="required an API key"):
        recorded.argv_and_env("8000")
    assert recorded.argv_and_env("") == ([], {"CHUNKSCOPE_API_KEY": None})  # no API: no key, none inherited
    assert ApiOptions().argv_and_env("8000")[1] == {"CHUNKSCOPE_API_KEY": None}   # not the dashboard's own key
    # A restart of a restart: the key came from the environment, so only the run's workload says it was needed.
    again = ApiOptions.from_run({"command_line": "serve --api-port 8000",
                                 "workload": {"kind": "chat", "api_key_required": True}})
    assert again.needs_key and ApiOptions.from_command_line("serve --api-k <redacted> --api-port 1").needs_key
    with pytest.raises(ApiOptionError, match="required an API key"):
        again.argv_and_env("8000")
    for bad_key in ("a\0b", "line\nbreak", "   "):
        with pytest.raises(ApiOptionError, match="printable"):
            ApiOptions().argv_and_env("8000", key=bad_key)
    assert ApiOptions().argv_and_env("0")[0][:2] == ["--api-port", "0"]       # 0: any free port, as serve takes it
    for bad in ("65536", "80a", "-1", "８０００", "1_000", "9" * 5000):
        with pytest.raises(ApiOptionError, match="not a port number") as caught:
            ApiOptions().argv_and_env(bad)
        assert len(str(caught.value)) < 140
    for bad_host in ("", "--debug", "a b", "x;rm"):
        with pytest.raises(ApiOptionError, match="API host"):
            ApiOptions(host=bad_host).argv_and_env("8000")
    # The start form turns the refusal into its one-line error.
    with pytest.raises(engine_control.EngineControlError, match="not a port number"):
        engine_control.start_engine(RunPaths(Path("/nonexistent-run-dir")), "tiny", "chat", 4, ApiOptions(), "x")


def test_a_killed_engine_is_dead_before_its_parent_reaps_it():
    """./run.sh or a test reaps a SIGKILLed engine when it gets round to it; until then its pid still
    answers a signal check, and the sidebar must not call the run running meanwhile."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert is_pid_alive(proc.pid) and not is_zombie(proc.pid)
        proc.send_signal(signal.SIGKILL)
        deadline = 200
        while not is_zombie(proc.pid) and deadline:
            subprocess.run(["sleep", "0.05"])
            deadline -= 1
        assert is_zombie(proc.pid) and not is_pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
