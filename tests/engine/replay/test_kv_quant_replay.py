"""A served InnerQ run replays decision- and token-identical from its bundle; the format travels in it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.__main__ import main
from engine.replay.rerun import load_input, replay_run
from engine.replay.compare import compare
from telemetry.bundle_export import export_bundle

from serve_process import REPO_ROOT

ARGS = ["--workload", "multiturn", "--requests", "12", "--rate", "30", "--kv-cache-dtype", "innerq4",
        "--kv-calib-tokens", "64", "--kv-cache-mb", "0.25", "--kv-recent-tokens", "16", "--seed", "2"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("innerq-replay")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                           *ARGS], cwd=REPO_ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return export_bundle(run_dir / "telemetry.db", run_dir / "bundle.zip").path


def test_a_quantized_run_replays_identically(bundle):
    recorded, manifest = load_input(str(bundle))
    assert recorded.config["kv_cache_dtype"] == "innerq4" and recorded.config["kv_recent_tokens"] == 16
    assert manifest["engine_config"]["kv_cache_dtype"] == "innerq4"   # the bundle says it up front
    states = {c.kv_quant_state for c in recorded.chunks}
    assert states == {"calibrating", "ready", "applied"}, "the run must cover the whole calibration"
    replayed = replay_run(recorded, model="tiny")
    report = compare(recorded, replayed)
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"]
    assert [c.kv_quant_state for c in replayed.chunks] == [c.kv_quant_state for c in recorded.chunks]


def test_replay_can_flip_the_cache_format(bundle, capsys):
    assert main(["replay", str(bundle), "--json", "--kv-cache-dtype", "auto"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["decisions_identical"] is False, "full precision holds fewer tokens in 0.25 MiB: other decisions"
    assert main(["replay", str(bundle), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_identical"] is True
