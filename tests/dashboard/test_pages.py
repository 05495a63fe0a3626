"""Every page through AppTest against a database written by the telemetry writer.

Expected numbers come from the event stream itself (``run_fixture.events``),
never from the dashboard's own queries.
"""
import json

from plotly_spec import chart_with, charts, texts

from dashboard.figures.timeline import TIMELINE_UIREVISION


def test_live_counters_timeline_and_latency(app, run_fixture):
    at = app()  # the router opens on Live
    assert at.title[0].value == "Live"
    last = run_fixture.of("Tick")[-1]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["waiting"] == str(last.num_waiting)
    assert metrics["active (decoding)"] == str(last.num_active)
    assert metrics["KV blocks"] == f"{last.kv_blocks_used} / {last.kv_blocks_total}"
    # the synthetic run writes ticks as a store from before the KV token / byte columns: '-'
    assert last.kv_tokens_used is None and metrics["KV tokens"] == "-" and metrics["KV MiB"] == "-"
    assert metrics["SSM slots"] == f"{last.ssm_slots_used} / {last.ssm_slots_total}"
    assert metrics["tick"] == str(last.tick)

    spec = chart_with(at, uirevision=TIMELINE_UIREVISION)
    forwards = [t for t in spec["data"] if t["name"].endswith(" forward")]
    by_path = {t["name"].split()[0]: len(t["x"]) for t in forwards}
    expected = run_fixture.counter("Tick", "path")
    expected.pop("idle", None)
    assert by_path == dict(expected)          # the 10 s window covers this short run
    names = {t["name"]: t for t in spec["data"]}
    assert len(names["preemption"]["x"]) == len(run_fixture.of("Preemption"))
    assert len(names["lever change"]["x"]) == len(run_fixture.of("LeverChange"))
    records = run_fixture.counter("StreamEvent", "kind")["record"]
    assert names["record → wait"]["x"].count(None) == records   # every chunk hand-off is linked

    latency = at.dataframe[0].value.set_index("metric")
    with_first_token = [r for r in run_fixture.final_requests().values() if r.first_token_ns is not None]
    assert latency.loc["TTFT", "count"] == len(with_first_token)
    assert latency.loc["ITL", "p50_ms"] > 0
    assert any("No engine running" in w.value for w in at.warning)


def test_live_window_slider_shrinks_timeline(app, run_fixture):
    at = app()
    at.select_slider(key="live_window_s").set_value(2).run()
    assert "last 2 s" in texts(at)


def test_chunks_filters_counts_and_charts(app, run_fixture):
    at = app("chunks")
    chunks = run_fixture.of("ChunkDecision")
    assert f"**{len(chunks)} chunk decisions**" in texts(at)
    assert len(at.dataframe[0].value) == len(chunks)
    hist = chart_with(at, uirevision="chunk-hist")
    assert sum(sum(t["y"]) for t in hist["data"]) == len(chunks)
    share = chart_with(at, uirevision="mix-share")
    assert sum(share["data"][0]["y"]) == sum(c.path == "mixed" for c in chunks)

    at.multiselect(key="chunks_blocker").set_value(["bisect_no_mix"]).run()
    blocked = [c for c in chunks if c.mix_blocker == "bisect_no_mix"]
    assert blocked and f"**{len(blocked)} chunk decisions**" in texts(at)
    assert set(at.dataframe[0].value["mix_blocker"]) == {"bisect_no_mix"}

    at.multiselect(key="chunks_blocker").set_value([]).run()
    rid = chunks[0].request_id
    at.text_input(key="chunks_request").set_value(str(rid)).run()
    assert f"**{sum(c.request_id == rid for c in chunks)} chunk decisions**" in texts(at)
    at.text_input(key="chunks_request").set_value("x1").run()
    assert "is not an id" in at.error[0].value
    # the Requests search's grammar on Chunks too: lists and ranges (issue 29, item 10)
    ids = sorted({c.request_id for c in chunks})
    at.text_input(key="chunks_request").set_value(f"{ids[0]}-{ids[1]}, {ids[-1]}").run()
    wanted = sum(c.request_id in (ids[0], ids[1], ids[-1]) or ids[0] <= c.request_id <= ids[1] for c in chunks)
    assert f"**{wanted} chunk decisions**" in texts(at)


def test_requests_waterfall_search_and_errors(app, run_fixture):
    at = app("requests")
    final = run_fixture.final_requests()
    assert f"**{len(final)} requests**" in texts(at)
    spec = chart_with(at, uirevision="waterfall")
    assert {y for t in spec["data"] for y in t["y"]} == {f"req {r}" for r in final}
    errors = [r for r in final.values() if r.status == "error"]
    assert len(at.dataframe[-1].value) == len(errors)
    assert set(at.dataframe[-1].value["error"]) == {r.error for r in errors}

    preempted = run_fixture.of("Preemption")[0].victim_request_id
    at.text_input(key="requests_search").set_value(str(preempted)).run()
    spec = chart_with(at, uirevision="waterfall")
    assert {y for t in spec["data"] for y in t["y"]} == {f"req {preempted}"}
    assert "preempted" in {t["name"] for t in spec["data"]}
    table = at.dataframe[0].value
    assert list(table["request_id"]) == [preempted]
    assert table["prefix_hit_tokens"].iloc[0] == final[preempted].prefix_hit_tokens

    at.text_input(key="requests_search").set_value("5-oops").run()
    assert "type an id" in at.error[0].value


def test_levers_widgets_write_file_and_show_state(app, run_fixture, tmp_path):
    import json

    at = app("levers")
    from telemetry.levers import LEVERS
    labels = {w.label for w in list(at.toggle) + list(at.text_input) + list(at.selectbox)}
    assert {lever.name for lever in LEVERS} <= labels
    assert all(w.help for w in at.toggle)
    assert "rejected: max_prefill_tokens must be >= 1" in texts(at)

    levers_file = run_fixture.run_dir / "levers.json"
    try:
        next(t for t in at.toggle if t.label == "bisect_no_mix").set_value(True).run()
        written = json.loads(levers_file.read_text())
        # the synthetic run's telemetry reports file version 2: the write goes above it
        assert written == {"version": 3, "levers": {"bisect_no_mix": True}}
        assert "**pending** · pending `True` · applied `False`" in texts(at)
        # a rebuilt widget reads the file, not the session
        at2 = app("levers")
        assert next(t for t in at2.toggle if t.label == "bisect_no_mix").value is True
        next(n for n in at2.text_input if n.label == "slice_budget").input("32").run()
        written = json.loads(levers_file.read_text())
        assert written == {"version": 4, "levers": {"bisect_no_mix": True, "slice_budget": 32}}
        levers_file.write_text("{not json")
        at3 = app("levers")
        assert "levers file is rejected" in at3.warning[0].value
    finally:
        levers_file.unlink(missing_ok=True)


def test_runs_compare_and_crashed(app, run_fixture):
    at = app("runs")
    assert "**2 runs**" in texts(at) and "1 crashed" in texts(at)
    listing = at.dataframe[0].value
    assert dict(zip(listing["run_id"], listing["status"])) == {1: "finished", 2: "crashed"}
    assert {"dtype", "cpu", "failure reason"} <= set(listing.columns)   # None: the synthetic runs record none
    at.selectbox(key="runs_a").set_value(1).run()
    at.selectbox(key="runs_b").set_value(2).run()
    compare = at.dataframe[1].value
    assert list(compare.columns) == ["run 1 (finished)", "run 2 (crashed)"]
    assert compare.loc["preemptions", "run 1 (finished)"] == len(run_fixture.of("Preemption"))
    assert compare.loc["requests", "run 2 (crashed)"] == len(run_fixture.final_requests(run_fixture.events2))
    chunks2 = run_fixture.of("ChunkDecision", run_fixture.events2)
    assert compare.loc["mixed_share", "run 2 (crashed)"] == round(
        sum(c.path == "mixed" for c in chunks2) / len(chunks2), 3)
    spec = chart_with(at, uirevision="runs-compare")
    assert [t["name"] for t in spec["data"]] == ["run 1 (finished)", "run 2 (crashed)"]
    # the lever table is the one with a "differs" column (a run with rooflines adds their table before it)
    levers = next(frame.value for frame in at.dataframe if "differs" in frame.value.columns)
    assert levers.loc["max_prefill_tokens", "differs"]


def test_run_picker_selects_run(app, run_fixture):
    at = app("chunks", run_id=None)   # default: the latest run (2)
    chunks2 = run_fixture.of("ChunkDecision", run_fixture.events2)
    assert f"**{len(chunks2)} chunk decisions** match in run 2" in texts(at)
