"""Bundle export from the Runs page and the replay divergence check (a real ``engine replay`` subprocess)."""
import os
import zipfile
from pathlib import Path

import pytest
from test_real_run import frame_by_key

from dashboard import bundles, replay_check
from dashboard.paths import RunPaths
from telemetry.bundle import BUNDLE_MEMBERS, BundleError

REPLAY_TIMEOUT_S = 240


def test_build_bundle_from_runs_page(real_app, real_run_dir):
    rr = real_run_dir
    at = real_app("runs")
    before = set((rr.run_dir / "bundles").glob("*.zip"))
    at.button(key="bundle_build").click().run(timeout=60)
    assert not at.exception and not at.error
    [built] = set((rr.run_dir / "bundles").glob("*.zip")) - before
    assert built.name.startswith("run1-")
    assert any(f"Wrote `{built}`" in s.value for s in at.success)
    assert f"`{built.name}` · {bundles.format_size(built.stat().st_size)}" in [m.value for m in at.markdown]
    assert "Download" in [b.label for b in at.get("download_button")]
    with zipfile.ZipFile(built) as zf:
        assert set(BUNDLE_MEMBERS) <= set(zf.namelist())
        workload = zf.read("workload.jsonl").decode().splitlines()
    assert len(workload) == rr.one("SELECT COUNT(*) FROM requests")


def test_build_bundle_time_window_and_refusals(real_run_dir, tmp_path):
    paths = RunPaths(real_run_dir.run_dir)
    result = bundles.build_bundle(paths, 1, since_s=0.0, until_s=2.0)
    assert result.path.parent == paths.run_dir / "bundles" and result.path.name.endswith("-w0-2s.zip")
    assert result.manifest["time_range"]["is_windowed"]
    # a windowed bundle is not offered to the replay (it would fail only after the click)
    whole = bundles.build_bundle(paths, 1)
    offered, left_out = bundles.replayable_bundles(bundles.list_bundles(paths))
    assert whole.path in [b.path for b in offered] and result.path not in [b.path for b in offered]
    assert left_out >= 1 and bundles.is_windowed(result.path) is True
    with pytest.raises(BundleError, match="holds no tick of run 1"):
        bundles.build_bundle(paths, 1, since_s=100_000.0)     # past the run's end: no empty bundle
    with pytest.raises(BundleError, match="until"):
        bundles.build_bundle(paths, 1, since_s=5.0, until_s=5.0)
    with pytest.raises(BundleError, match="no telemetry database"):
        bundles.build_bundle(RunPaths(tmp_path), 1)


def test_bundle_names_listing_and_lazy_reader(tmp_path):
    paths = RunPaths(tmp_path)
    first = bundles.new_bundle_path(paths, 3, None, None, now=0)
    first.parent.mkdir()
    first.write_bytes(b"one")
    second = bundles.new_bundle_path(paths, 3, None, None, now=0)
    assert second != first and second.name.endswith("-2.zip")
    (first.parent / "notes.txt").write_text("x")
    (first.parent / "link.zip").symlink_to(first)
    assert [b.path for b in bundles.list_bundles(paths)] == [first]
    reader = bundles.file_reader(first)
    first.write_bytes(b"two")            # read at click time, not when the button was drawn
    assert reader() == b"two"
    assert bundles.list_bundles(RunPaths(tmp_path / "absent")) == []
    assert bundles.format_size(1500) == "1.5 kB" and bundles.format_size(2_500_000) == "2.5 MB"


def test_replay_argv_guards_paths_and_flips(tmp_path):
    paths = RunPaths(tmp_path / "run")
    (tmp_path / "run" / "bundles").mkdir(parents=True)
    bundle = tmp_path / "run" / "bundles" / "b.zip"
    bundle.write_bytes(b"")
    argv = replay_check.replay_argv(paths, bundle, {"bisect_no_mix": True, "max_prefill_tokens": 64})
    assert argv[1:] == ["-m", "engine", "replay", str(bundle.resolve()), "--json",
                        "--flip", "bisect_no_mix=true", "--flip", "max_prefill_tokens=64"]
    (tmp_path / "outside.zip").write_bytes(b"")
    with pytest.raises(replay_check.ReplayCheckError, match="outside the run directory"):
        replay_check.replay_argv(paths, tmp_path / "outside.zip", {})
    with pytest.raises(replay_check.ReplayCheckError, match="not a bundle .zip"):
        replay_check.replay_argv(paths, "bundles", {})
    with pytest.raises(replay_check.ReplayCheckError, match="unknown lever"):
        replay_check.flip_text("no_such_lever", True)
    with pytest.raises(replay_check.ReplayCheckError, match="expected bool"):
        replay_check.flip_text("bisect_no_mix", 1)


def test_parse_report_contract():
    with pytest.raises(replay_check.ReplayCheckError, match="no JSON report"):
        replay_check.parse_report("Traceback...\nboom")
    with pytest.raises(replay_check.ReplayCheckError, match="lacks first_divergence, requests"):
        replay_check.parse_report('{"decisions_identical": true, "tokens_identical": true}')
    report = replay_check.parse_report('warming up\n{"decisions_identical": true, "tokens_identical": true, '
                                       '"first_divergence": null, "requests": []}')
    assert report["requests"] == []


def _row(rid, same, diff=None):
    return {"request_id": rid, "tokens_identical": same, "first_token_diff": diff, "recorded_len": 8,
            "replayed_len": 8, "status_recorded": "finished", "status_replayed": "finished"}


def test_headline_and_table():
    same = {"decisions_identical": False, "tokens_identical": True, "first_divergence":
            {"tick": 3, "request_id": 0, "field": "chunk.path"}, "requests": [_row(0, True), _row(1, True)]}
    assert replay_check.headline(same) == (
        "success", "Batch-invariant: no token differs in 2 requests (chunk decisions different).")
    differ = {"decisions_identical": False, "tokens_identical": False, "first_divergence":
              {"tick": 12, "request_id": 1, "field": "output_tokens[4]"},
              "requests": [_row(0, True), _row(1, False, 4), _row(2, False, 0)]}
    level, text = replay_check.headline(differ)
    assert level == "warning"
    assert text == ("2 of 3 requests differ (chunk decisions different); first divergence at tick 12 "
                    "request 1 field output_tokens[4].")
    table = replay_check.request_table(differ)
    assert list(table["request_id"]) == [1, 2, 0]
    assert list(table.columns) == list(replay_check.REQUEST_COLUMNS)


def _replay_at(real_app, real_run_dir):
    paths = RunPaths(real_run_dir.run_dir)
    bundle = bundles.build_bundle(paths, 1).path
    at = real_app("runs")
    at.selectbox(key="replay_bundle").set_value(str(bundle)).run()
    return at, bundle


def test_flip_replay_on_runs_page(real_app, real_run_dir):
    """A real ``engine replay --flip bisect_no_mix=true --json``; the table and headline agree with it."""
    rr = real_run_dir
    at, bundle = _replay_at(real_app, rr)
    at.selectbox(key="replay_lever").set_value("bisect_no_mix").run()
    assert at.toggle(key="replay_value_bisect_no_mix").value is True   # the flipped value by default
    at.button(key="replay_flip").click().run(timeout=REPLAY_TIMEOUT_S)
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert f"`{bundle}` with `bisect_no_mix=True`" in " ".join(c.value for c in at.caption)
    table = frame_by_key(at, "replay_requests")
    recorded = dict(rr.rows("SELECT request_id, output_len FROM requests"))
    assert set(table["request_id"]) == set(recorded)
    assert dict(zip(table["request_id"], table["recorded_len"])) == recorded
    num_differ = int((~table["tokens_identical"].astype(bool)).sum())
    messages = [m.value for m in list(at.success) + list(at.warning)]
    if num_differ == 0:
        assert f"Batch-invariant: no token differs in {len(table)} requests" in " ".join(messages)
    else:
        assert any(m.startswith(f"{num_differ} of {len(table)} requests differ") for m in messages)
    # the recorded run mixed before the flip; with bisect_no_mix for the whole replay, decisions differ
    assert rr.one("SELECT COUNT(*) FROM chunks WHERE path = 'mixed'") > 0
    assert "chunk decisions different" in " ".join(messages)


def test_replay_failure_shows_the_one_line_error(real_app, real_run_dir):
    broken = real_run_dir.run_dir / "bundles" / "zz-broken.zip"
    broken.parent.mkdir(exist_ok=True)
    broken.write_bytes(b"this is not a zip")
    os.utime(broken, (2e9, 2e9))       # newest: the default choice
    try:
        at = real_app("runs")
        assert at.selectbox(key="replay_bundle").value == str(broken)
        at.button(key="replay_plain").click().run(timeout=REPLAY_TIMEOUT_S)
        assert not at.exception
        [error] = [e.value for e in at.error]
        assert error.startswith("replay failed (exit 2): error: bundle") and "not a zip file" in error
        assert "\n" not in error
    finally:
        broken.unlink()



def test_the_replay_check_reports_its_progress_tick_by_tick(real_run_dir):
    """The Runs page's bar: ``engine replay --progress-lines`` read while it runs, up to the recorded ticks."""
    paths = RunPaths(real_run_dir.run_dir)
    bundle = bundles.build_bundle(paths, 1).path
    seen: list[tuple[int, int]] = []
    outcome = replay_check.run_replay(paths, bundle, on_progress=lambda tick, total: seen.append((tick, total)))
    assert outcome.report["tokens_identical"]
    num_ticks = real_run_dir.one("SELECT COUNT(*) FROM ticks")
    assert seen and seen[-1] == (num_ticks, num_ticks), seen[-3:]
    assert [tick for tick, _ in seen] == sorted(tick for tick, _ in seen)
    assert {total for _, total in seen} == {num_ticks}


def _replays_of_ours() -> list[int]:
    """Our live child processes running ``engine replay``."""
    pid = os.getpid()
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"engine replay" in Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ")]


def test_a_replay_the_page_leaves_or_that_times_out_is_killed_not_orphaned(real_run_dir):
    """A rerun of the page raises inside the progress callback (Streamlit's RerunException); a timeout
    raises in the poll: either way the replay subprocess goes with it."""
    paths = RunPaths(real_run_dir.run_dir)
    bundle = bundles.build_bundle(paths, 1).path

    def page_rerun(tick, total):
        raise KeyboardInterrupt("the page reran")

    with pytest.raises(KeyboardInterrupt):
        replay_check.run_replay(paths, bundle, on_progress=page_rerun)
    assert _replays_of_ours() == []
    with pytest.raises(replay_check.ReplayCheckError, match="did not finish within 0.5 s"):
        replay_check.run_replay(paths, bundle, timeout_s=0.5)
    assert _replays_of_ours() == []
