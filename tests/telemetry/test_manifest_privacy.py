"""The manifest's privacy rules as functions: absolute paths leave only their basename (or become relative
to the run directory), only allow-listed environment variables ship, and the lever timeline is ordered."""
from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

from telemetry import events as ev
from telemetry.manifest import allowed_environment, build_manifest, lever_timeline, sanitize, sanitize_text

RUN_DIR = Path("/srv/runs/r1")


def test_paths_in_text_become_relative_or_their_basename():
    cases = {
        "/srv/runs/r1/telemetry.db": "telemetry.db",
        "/srv/runs/r1": ".",
        "--model /home/me/ckpt/qwen --dtype auto": "--model qwen --dtype auto",
        "trace:/data/azure.csv": "trace:azure.csv",
        "see ~/models/q3 now": "see q3 now",
        "C:\\Users\\me\\weights.bin": "weights.bin",
        "a=/etc/passwd,b=(/tmp/x)": "a=passwd,b=(x)",
        "/srv/runs/r1/../r2/secret.txt": "secret.txt",   # normalised first: it is outside the run dir
        '"/opt/model"': '"model"',
    }
    for text, expected in cases.items():
        assert sanitize_text(text, RUN_DIR) == expected, text


def test_relative_paths_and_plain_words_are_left_alone():
    for text in ("rel/path/x", "x/./y", "tiny", "a/b/c.json", "ratio 3/4", "/"):
        assert sanitize_text(text, RUN_DIR) == text


_words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=3, max_size=10)


@settings(max_examples=60, deadline=None)
@given(dirs=st.lists(_words, min_size=1, max_size=4), name=_words, before=_words, after=_words,
       joiner=st.sampled_from([" ", "=", ":", ",", " '", "("]))
def test_no_directory_of_an_outside_path_survives(dirs, name, before, after, joiner):
    dirs = [f"D{d}" for d in dirs]          # upper case: never part of the lower-case words around them
    path = "/" + "/".join(dirs + [name])
    out = sanitize_text(f"{before}{joiner}{path} {after}", RUN_DIR)
    assert out == f"{before}{joiner}{name} {after}"
    assert not any(d in out for d in dirs)


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(_words, min_size=1, max_size=3))
def test_a_path_inside_the_run_dir_keeps_its_relative_part(parts):
    relative = "/".join(parts)
    assert sanitize_text(f"file {RUN_DIR}/{relative}", RUN_DIR) == f"file {relative}"


def test_sanitize_walks_keys_lists_and_leaves_non_strings():
    value = {"/home/me/a.db": [1, "/x/y/z", {"k": "/srv/runs/r1/levers.json"}], "n": 2.5, "flag": None}
    assert sanitize(value, RUN_DIR) == {"a.db": [1, "z", {"k": "levers.json"}], "n": 2.5, "flag": None}
    assert sanitize(("/a/b",), RUN_DIR) == ["b"]


def test_only_allow_listed_variables_ship_and_their_paths_are_cut():
    environ = {"OMP_NUM_THREADS": "4", "CHUNKSCOPE_CACHE": "/home/me/.cache/chunkscope", "HOME": "/home/me",
               "AWS_SECRET_ACCESS_KEY": "hunter2", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0",
               "MY_CHUNKSCOPE_X": "1"}
    assert allowed_environment(environ, RUN_DIR) == {"CHUNKSCOPE_CACHE": "chunkscope", "CUDA_VISIBLE_DEVICES": "0",
                                                     "OMP_NUM_THREADS": "4"}


def test_the_lever_timeline_orders_changes_by_tick_then_id_and_keeps_rejections():
    run = {"levers": {"bisect_no_mix": False, "max_prefill_tokens": 256}}
    changes = [
        {"id": 3, "tick": 9, "name": "bisect_no_mix", "old": False, "new": True, "source": "file",
         "status": "applied", "t_ns": 30, "extra": "dropped"},
        {"id": 2, "tick": 4, "name": "max_prefill_tokens", "old": 256, "new": -1, "source": "file",
         "status": "rejected", "reason": "out of range", "t_ns": 20},
        {"id": 1, "tick": 9, "name": "max_prefill_tokens", "old": 256, "new": 64, "source": "dashboard",
         "status": "applied", "t_ns": 10},
    ]
    timeline = lever_timeline(run, changes)
    assert timeline["start"] == run["levers"] and timeline["start"] is not run["levers"]
    assert [(c["tick"], c["new"]) for c in timeline["changes"]] == [(4, -1), (9, 64), (9, True)]
    assert timeline["changes"][0]["reason"] == "out of range" and timeline["changes"][1]["reason"] is None
    assert all("extra" not in c and "id" not in c for c in timeline["changes"])
    assert lever_timeline({"levers": None}, []) == {"start": {}, "changes": []}


def test_a_manifest_holds_no_private_path_and_says_when_it_is_windowed(tmp_path):
    run_dir = tmp_path / "run"
    run = {"run_id": 7, "status": "finished", "model": "/home/me/ckpt/Qwen3.5-0.8B",
           "command_line": f"python -m engine serve --run-dir {run_dir} --model /home/me/ckpt/Qwen3.5-0.8B",
           "config": {"levers_file": str(run_dir / "levers.json"), "trace": "/data/private/trace.csv"},
           "levers": {"bisect_no_mix": False}, "schema_version": None}
    manifest = build_manifest(run=run, lever_changes=[], extent={"first_ns": 0, "last_ns": 10}, since_ns=5,
                              until_ns=None, counts={"ticks": 3}, files={}, run_dir=run_dir, bundle_format=1,
                              environ={"HOME": "/home/me", "CHUNKSCOPE_KERNEL_ISA": "avx2"})
    text = json.dumps(manifest)
    assert "/home/me" not in text and "/data/private" not in text and str(tmp_path) not in text
    assert manifest["run"]["model"] == "Qwen3.5-0.8B"
    assert manifest["command_line"] == "python -m engine serve --run-dir . --model Qwen3.5-0.8B"
    assert manifest["engine_config"] == {"levers_file": "levers.json", "trace": "trace.csv"}
    assert manifest["environment"] == {"CHUNKSCOPE_KERNEL_ISA": "avx2"}
    assert manifest["time_range"] == {"since_ns": 5, "until_ns": None, "is_windowed": True, "first_ns": 0,
                                      "last_ns": 10}
    assert manifest["schema_version"] == ev.SCHEMA_VERSION, "an old run row without one gets today's"
    exporter = manifest["versions"]["exporter"]
    assert exporter["python"].count(".") == 2 and set(exporter) >= {"sqlite", "torch", "streamlit"}
