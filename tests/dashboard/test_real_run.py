"""Every page against the database of a short real engine run (``real_run.py``).

Expected numbers come from plain SQL on that database, never from the
dashboard's own queries.
"""
import json

import numpy as np
import pytest

from plotly_spec import chart_with, charts, texts

from dashboard.figures.timeline import TIMELINE_UIREVISION
from telemetry import events as ev
from telemetry.levers import LEVERS


FRAME_COLUMNS = {  # AppTest does not expose a dataframe's key: find each table by its columns
    "prefix_miss_reasons": {"reason", "num_requests", "example"},
    "requests_table": {"prefix_miss_reason", "prefix_hit_ratio", "ttft_ms"},
    "requests_errors": {"request_id", "status", "error", "at_ms"},
    "runs_table": {"run_id", "status", "started"},
    "replay_requests": {"tokens_identical", "first_token_diff", "recorded_len"},
    "runs_roofline": {"forwards", "time_weighted_share", "p50_share"},
}


def frame_by_key(at, key):
    for df in at.dataframe:
        if FRAME_COLUMNS[key] <= set(df.value.columns):
            return df.value
    raise AssertionError(f"no dataframe like {key}")


def test_real_live_counters_timeline_markers(real_app, real_run_dir):
    rr = real_run_dir
    at = real_app()
    at.select_slider(key="live_window_s").set_value(300).run()
    last = rr.rows("SELECT tick, num_waiting, num_active, kv_blocks_used, kv_blocks_total, ssm_slots_used, "
                   "ssm_slots_total, kv_tokens_used, kv_tokens_total, kv_bytes_used, kv_bytes_total "
                   "FROM ticks ORDER BY tick DESC LIMIT 1")[0]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["tick"] == str(last[0])
    assert metrics["waiting"] == str(last[1]) and metrics["active (decoding)"] == str(last[2])
    # full precision: token slots and bytes go with blocks
    assert last[4] == 24 and last[7] == 16 * last[3] and last[8] == 16 * last[4]
    assert last[9] * last[4] == last[10] * last[3]
    assert metrics["KV blocks"] == f"{last[3]} / {last[4]}"
    assert metrics["KV tokens"] == f"{last[7]:,} / {last[8]:,}"
    assert metrics["KV MiB"] == f"{last[9] / 2 ** 20:.1f} / {last[10] / 2 ** 20:.1f}"
    assert metrics["SSM slots"] == f"{last[5]} / {last[6]}"

    spec = chart_with(at, uirevision=TIMELINE_UIREVISION)
    by_path = {t["name"].split()[0]: len(t["x"]) for t in spec["data"] if t["name"].endswith(" forward")}
    assert by_path == dict(rr.rows("SELECT path, COUNT(*) FROM ticks WHERE path != 'idle' GROUP BY path"))
    names = {t["name"]: t for t in spec["data"]}
    num_preemptions = rr.one("SELECT COUNT(*) FROM preemptions")
    assert num_preemptions > 0, "the 24-block cache should force preemptions"
    assert len(names["preemption"]["x"]) == num_preemptions
    # the env lever at tick 0 and the levers-file write mid-run
    assert len(names["lever change"]["x"]) == rr.one("SELECT COUNT(*) FROM lever_changes") == 2
    # The roofline lane: one marker per forward, coloured by the engine's roofline over the measured time.
    # A tick whose forward raised (the fault hook) ran no forward and records none.
    shares = [share for (share,) in rr.rows("SELECT roofline_ns * 1.0 / duration_ns FROM ticks "
                                            "WHERE path != 'idle' ORDER BY tick") if share is not None]
    assert len(shares) > 0.9 * sum(by_path.values()) and all(0 < share for share in shares)
    assert names["roofline share"]["marker"]["color"] == pytest.approx(
        np.log10(np.clip(shares, 0.01, 1.0)).tolist())   # log-scaled colour (roofline_lane.roofline_color_values)
    assert names["roofline share"]["text"] == [f"{share:.1%}" for share in shares]
    latency = at.dataframe[0].value.set_index("metric")
    assert latency.loc["TTFT", "count"] == rr.one("SELECT COUNT(*) FROM requests WHERE first_token_ns IS NOT NULL")


def test_real_live_prefix_cache_strip(real_app, real_run_dir):
    rr = real_run_dir
    at = real_app()
    metrics = {m.label: m.value for m in at.metric}
    events = dict(rr.rows("SELECT kind, COUNT(*) FROM events GROUP BY kind"))
    assert events.get("snapshot_taken", 0) > 0
    for kind, label in (("prefix_hit", "prefix hits"), ("snapshot_taken", "snapshots taken"),
                        ("snapshot_restored", "snapshots restored"), ("snapshot_evicted", "snapshots evicted")):
        assert metrics[label] == str(events.get(kind, 0)), label
    hit, prompt = rr.rows("SELECT SUM(prefix_hit_tokens), SUM(prompt_len) FROM requests "
                          "WHERE admitted_ns IS NOT NULL")[0]
    assert metrics["hit ratio (run)"] == f"{hit / prompt:.1%}"
    spec = chart_with(at, uirevision="prefix-hit")
    custom = spec["data"][0]["customdata"]
    assert sum(c[1] for c in custom) == hit and sum(c[2] for c in custom) == prompt
    assert sum(c[0] for c in custom) == rr.one("SELECT COUNT(*) FROM requests WHERE admitted_ns IS NOT NULL")
    reasons = frame_by_key(at, "prefix_miss_reasons")
    assert reasons["num_requests"].sum() == rr.one(
        "SELECT COUNT(*) FROM requests WHERE admitted_ns IS NOT NULL AND prefix_miss_reason != ''")
    assert any(r.startswith("no SSM snapshot") or r.startswith("no cached KV block") for r in reasons["reason"])


def test_real_chunks_counts_and_bisect_blocker(real_app, real_run_dir):
    rr = real_run_dir
    at = real_app("chunks")
    num_chunks = rr.one("SELECT COUNT(*) FROM chunks")
    assert f"**{num_chunks} chunk decisions**" in texts(at)
    share = chart_with(at, uirevision="mix-share")
    assert sum(share["data"][0]["y"]) == rr.one("SELECT COUNT(*) FROM chunks WHERE path = 'mixed'")
    hist = chart_with(at, uirevision="chunk-hist")
    assert sum(sum(t["y"]) for t in hist["data"]) == num_chunks
    flipped_at = rr.one("SELECT tick FROM lever_changes WHERE name = 'bisect_no_mix'")
    # after the mid-run flip the engine never mixes
    assert rr.one("SELECT COUNT(*) FROM chunks WHERE tick > ? AND path = 'mixed'", [flipped_at]) == 0
    blocked = rr.one("SELECT COUNT(*) FROM chunks WHERE mix_blocker = 'bisect_no_mix'")
    at.multiselect(key="chunks_blocker").set_value(["bisect_no_mix"]).run()
    assert f"**{blocked} chunk decisions**" in texts(at)


def test_real_requests_waterfall_prefix_and_errors(real_app, real_run_dir):
    rr = real_run_dir
    at = real_app("requests")
    counts = dict(rr.rows("SELECT status, COUNT(*) FROM requests GROUP BY status"))
    assert f"**{sum(counts.values())} requests**" in texts(at)
    assert ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) in texts(at)
    spec = chart_with(at, uirevision="waterfall")
    shown = {y for t in spec["data"] for y in t["y"]}
    assert shown == {f"req {r}" for (r,) in rr.rows("SELECT request_id FROM requests")}
    table = frame_by_key(at, "requests_table").set_index("request_id")
    expected = dict(rr.rows("SELECT request_id, prefix_miss_reason FROM requests"))
    assert {k: (v or "") for k, v in table["prefix_miss_reason"].fillna("").items()} == \
           {k: (v or "") for k, v in expected.items()}
    hits = dict(rr.rows("SELECT request_id, prefix_hit_tokens FROM requests"))
    assert table["prefix_hit_tokens"].to_dict() == hits
    errors = frame_by_key(at, "requests_errors")
    assert set(errors["request_id"]) == {r for (r,) in rr.rows("SELECT request_id FROM requests WHERE status "
                                                                "IN ('error', 'preempted', 'rejected')")}
    assert rr.one("SELECT COUNT(*) FROM requests WHERE status = 'rejected'") >= 1  # too long for 24 blocks
    assert any("more than the whole cache" in e for e in errors["error"])


def test_real_levers_applied_state_and_write(real_app, real_run_dir):
    rr = real_run_dir
    levers_file = rr.run_dir / "levers.json"
    original = levers_file.read_bytes()
    tick = rr.one("SELECT tick FROM lever_changes WHERE name = 'bisect_no_mix' AND status = 'applied'")
    try:
        at = real_app("levers")
        assert {lever.name for lever in LEVERS} <= {w.label for w in list(at.toggle) + list(at.text_input)
                                                    + list(at.selectbox)}
        assert f"**in sync** · pending `True` · applied `True` since tick {tick} (file)" in texts(at)
        assert "applied `True` since tick 0 (env)" in texts(at)           # ssm_tail_ckpt from the environment
        next(t for t in at.toggle if t.label == "always_mixed").set_value(True).run()
        written = json.loads(levers_file.read_text())
        assert written == {"version": 2, "levers": {"bisect_no_mix": True, "always_mixed": True}}
        assert "**pending** · pending `True` · applied `False`" in texts(at)
    finally:
        levers_file.write_bytes(original)


def test_real_runs_compare_metrics(real_app, real_run_dir):
    rr = real_run_dir
    at = real_app("runs")
    assert "**1 run**" in texts(at)
    listing = frame_by_key(at, "runs_table")
    assert list(listing["status"]) == ["finished"]
    # The dtype ``auto`` resolved to once, at the start, and the CPU it ran on (issue 26).
    config = json.loads(rr.one("SELECT config FROM runs"))
    assert list(listing["dtype"]) == [config["dtype"]] and config["dtype"] in ("float32", "bfloat16")
    assert listing["cpu"].iloc[0].startswith(config["cpu_model"]) and list(listing["failure reason"]) == [None]
    assert config["roofline_rates"]["gemm_dtype"] == config["dtype"]   # the roofline is the forward's dtype's
    compare = at.dataframe[1].value
    column = compare.columns[0]
    assert compare.loc["preemptions", column] == rr.one("SELECT COUNT(*) FROM preemptions")
    assert compare.loc["requests", column] == rr.one("SELECT COUNT(*) FROM requests")
    mixed, total = rr.rows("SELECT SUM(path = 'mixed'), COUNT(*) FROM chunks")[0]
    assert compare.loc["mixed_share", column] == round(mixed / total, 3)
    hit, prompt = rr.rows("SELECT SUM(prefix_hit_tokens), SUM(prompt_len) FROM requests")[0]
    assert compare.loc["prefix_hit_ratio", column] == round(hit / prompt, 3)
    # Every end state on its own row, equal to the rows; errors is the failure states' sum.
    by_status = dict(rr.rows("SELECT status, count(*) FROM requests GROUP BY status"))
    assert {ev.REQ_FINISHED, ev.REQ_ERROR, ev.REQ_PREEMPTED, ev.REQ_REJECTED} <= set(by_status)
    for status in ev.END_STATUSES:
        assert compare.loc[status, column] == by_status.get(status, 0), status
    assert compare.loc["running", column] == 0
    assert compare.loc["errors", column] == sum(by_status.get(s, 0) for s in ev.FAILURE_STATUSES)

    roofline = frame_by_key(at, "runs_roofline")
    expected = rr.rows("SELECT path, COUNT(*), SUM(roofline_ns) * 1.0 / SUM(duration_ns) FROM ticks "
                       "WHERE path != 'idle' AND roofline_ns IS NOT NULL GROUP BY path ORDER BY path")
    assert [path for (_, path) in roofline.index] == [path for path, _, _ in expected]
    assert list(roofline["forwards"]) == [count for _, count, _ in expected]
    assert list(roofline["time_weighted_share"]) == [round(share, 3) for _, _, share in expected]
