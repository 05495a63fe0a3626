"""A served ``--api-key``: enforced, never recorded (the run's row and its bug-report bundle show
``<redacted>``), and taken from ``CHUNKSCOPE_API_KEY`` when the command line has none (how the
dashboard restarts such a run without putting the key on a command line)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import httpx
import pytest

from api_server_helpers import started_server
from serve_process import stop
from engine.api.launch import REDACTED, redacted_command_line
from telemetry.bundle_export import export_bundle


def test_redaction_hides_the_key_in_every_spelling_argparse_takes_and_nothing_else():
    argv = ["serve", "--api-key", "k1", "--run-dir", "r", "--api-key=k2", "--api-port", "80", "--api-k", "k3",
            "--api-ke=k4", "--api-host", "h"]
    assert redacted_command_line(argv) == ["serve", "--api-key", REDACTED, "--run-dir", "r",
                                           f"--api-key={REDACTED}", "--api-port", "80", "--api-k", REDACTED,
                                           f"--api-ke={REDACTED}", "--api-host", "h"]
    assert redacted_command_line(["serve", "--api-key"]) == ["serve", "--api-key"]


@pytest.mark.parametrize("where", ["argv", "environment"])
def test_the_key_is_enforced_and_never_lands_in_the_run_or_its_bundle(tmp_path, where):
    key = "s3cret-k3y"
    args, env = (["--api-k", key], None) if where == "argv" else ([], {"CHUNKSCOPE_API_KEY": key})
    server = started_server(tmp_path / "run", *args, env_extra=env)
    try:
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code == 200
    finally:
        status, stderr = stop(server.proc)
    assert status == 0, stderr
    (line,) = [r["command_line"] for r in server.rows("SELECT command_line FROM runs")]
    assert key not in line and (REDACTED in line) == (where == "argv")
    (workload,) = [r["workload"] for r in server.rows("SELECT workload FROM runs")]
    assert json.loads(workload)["api_key_required"] is True   # the fact a dashboard restart asks for the key by
    # Exported where the key is in the environment (as ./run.sh's dashboard would have it).
    bundle = export_bundle(server.db, tmp_path / "bundle.zip", environ={**os.environ, "CHUNKSCOPE_API_KEY": key}).path
    with zipfile.ZipFile(bundle) as archive:
        for name in archive.namelist():
            assert key.encode() not in archive.read(name), f"the key is in the bundle's {name}"


@pytest.mark.parametrize("args, env", [(["--api-key", " "], {}), ([], {"CHUNKSCOPE_API_KEY": ""})])
def test_an_empty_key_is_refused_in_one_line_rather_than_serving_an_open_api(tmp_path, args, env):
    done = subprocess.run([sys.executable, "-m", "engine", "serve", "--run-dir", str(tmp_path), "--workload", "none",
                           "--api-port", "0", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 2 and "the API key is empty" in done.stderr and "Traceback" not in done.stderr
