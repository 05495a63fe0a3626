"""The wording of CLI errors a user hits first: seconds where seconds were typed, --file everywhere,
and an advertised option (``generate --dtype bfloat16``) that works."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from telemetry.__main__ import main as telemetry_main

sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))
import synthetic_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_generate_bfloat16_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt-ids", "1,2,3", "--dtype", "bfloat16",
                           "--max-tokens", "4", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["tokens"]) == 4


def test_export_window_errors_speak_seconds(tmp_path, capsys):
    db = tmp_path / "t.db"
    synthetic_run.write_run(db, synthetic_run.SimConfig(num_requests=3))
    out = str(tmp_path / "o.zip")
    assert telemetry_main(["export", "--db", str(db), "-o", out, "--since-s", "5", "--until-s", "1"]) == 1
    err = capsys.readouterr().err
    assert "until (1 s) is not after since (5 s)" in err and " ns" not in err
    assert telemetry_main(["export", "--db", str(db), "-o", out, "--since-s", "100000"]) == 1
    err = capsys.readouterr().err
    assert "holds no tick of run 1" in err and "100000 s" in err and "None" not in err
    assert not Path(out).exists()
    assert telemetry_main(["export", "--db", str(db), "-o", out]) == 0
    capsys.readouterr()
    assert telemetry_main(["export", "--db", str(db), "-o", out]) == 1
    err = capsys.readouterr().err
    assert "--force" in err and "overwrite=True" not in err


def test_levers_validate_takes_file_like_get_and_set(tmp_path, capsys):
    path = tmp_path / "levers.json"
    assert telemetry_main(["levers", "set", "bisect_no_mix", "true", "--file", str(path)]) == 0
    assert telemetry_main(["levers", "validate", "--file", str(path)]) == 0
    assert telemetry_main(["levers", "validate", str(path)]) == 0      # the old positional form still works
    assert "version 1, 1 lever(s)" in capsys.readouterr().out
    assert telemetry_main(["levers", "validate"]) == 2
    assert "--file FILE" in capsys.readouterr().err
