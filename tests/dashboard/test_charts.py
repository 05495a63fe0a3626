"""Figure builders: DataFrame in, Figure out; checked through the figure's JSON spec."""
import numpy as np
import pandas as pd
import pytest
from plotly_spec import spec as decode_spec

from dashboard.figures import charts
from dashboard.figures.timeline import LANE_Y, TIMELINE_UIREVISION, WEBGL_THRESHOLD, timeline_figure


def _spec(fig):
    return decode_spec(fig.to_json())


def _forwards(n):
    paths = ["mixed", "prefill", "decode"]
    return pd.DataFrame({
        "tick": range(n), "start_ms": [i * 2.0 for i in range(n)], "dur_ms": [1.5] * n,
        "path": [paths[i % 3] for i in range(n)], "num_prefill_tokens": [64 if i % 3 < 2 else 0 for i in range(n)],
        "num_decode_tokens": [4 if i % 3 != 1 else 0 for i in range(n)],
        "request_id": [7 if i % 3 < 2 else None for i in range(n)],
        "chunk_len": [64 if i % 3 < 2 else None for i in range(n)],
        "decode_width": [4 if i % 3 == 0 else None for i in range(n)],
    })


def _empty(*cols):
    return pd.DataFrame({c: [] for c in cols})


NO_STREAMS = _empty("t_ms", "kind", "stream", "event_name", "seq", "tick", "gpu_elapsed_ms")
NO_LINKS = _empty("record_t_ms", "record_stream", "wait_t_ms", "wait_stream")
NO_PREEMPT = _empty("t_ms", "tick", "victim_request_id", "blocks_freed", "reason")
NO_LEVERS = _empty("t_ms", "tick", "name", "old", "new", "status")


def test_timeline_bars_one_trace_per_path_with_hover_detail():
    spec = _spec(timeline_figure(_forwards(9), NO_STREAMS, NO_LINKS, NO_PREEMPT, NO_LEVERS, (0, 20)))
    bars = [t for t in spec["data"] if t["type"] == "bar"]
    assert sorted(t["name"] for t in bars) == ["decode forward", "mixed forward", "prefill forward"]
    mixed = next(t for t in bars if t["name"] == "mixed forward")
    assert mixed["orientation"] == "h" and len(mixed["x"]) == 3
    assert mixed["base"][:2] == [0.0, 0.006]                                  # seconds since run start
    assert mixed["customdata"][0][0] == 0 and mixed["customdata"][0][3] == 7  # tick, request
    assert set(mixed["y"]) == {LANE_Y["scheduler"]}
    assert "decode width" in mixed["hovertemplate"]
    assert spec["layout"]["uirevision"] == TIMELINE_UIREVISION
    assert spec["layout"]["xaxis"]["range"] == [0, 0.02]
    assert spec["layout"]["xaxis"]["title"]["text"] == "s since run start"
    assert mixed["customdata"][0][6] == 1.5 and "%{customdata[6]:.3f} ms" in mixed["hovertemplate"]   # ms


def test_timeline_switches_to_webgl_segments_past_threshold():
    spec = _spec(timeline_figure(_forwards(WEBGL_THRESHOLD + 3), NO_STREAMS, NO_LINKS, NO_PREEMPT, NO_LEVERS))
    types = {t["type"] for t in spec["data"]}
    assert types == {"scattergl"}
    decode = next(t for t in spec["data"] if t["name"] == "decode forward")
    # each interval is start, end, gap
    assert len(decode["x"]) == 3 * ((WEBGL_THRESHOLD + 3) // 3)
    assert decode["x"][2] is None and decode["x"][1] - decode["x"][0] == pytest.approx(0.0015)


def test_timeline_draws_bucketed_rows_as_segments():
    buckets = pd.DataFrame({"start_ms": [0.0, 10.0], "end_ms": [9.0, 19.0], "path": ["decode", "decode"],
                            "num_ticks": [40, 38], "num_tokens": [160, 150]})
    spec = _spec(timeline_figure(buckets, NO_STREAMS, NO_LINKS, NO_PREEMPT, NO_LEVERS))
    (trace,) = spec["data"]
    assert trace["type"] == "scattergl" and trace["x"] == [0.0, 0.009, None, 0.01, 0.019, None]
    assert trace["customdata"][0] == [40, 160] and trace["y"][:3] == [LANE_Y["scheduler"]] * 2 + [None]


def test_timeline_streams_links_and_markers():
    streams = pd.DataFrame({
        "t_ms": [1.0, 2.0, 3.0], "kind": ["record", "wait", "sync"],
        "stream": ["prefill", "default", "default"], "event_name": ["kv_ready", "kv_ready", "end"],
        "seq": [5, 5, 6], "tick": [1, 1, 2], "gpu_elapsed_ms": [0.8, None, None],
        "target_stream": [None, "default", None]})
    links = pd.DataFrame({"record_t_ms": [1.0], "record_stream": ["prefill"],
                          "wait_t_ms": [2.0], "wait_stream": ["default"]})
    preempt = pd.DataFrame({"t_ms": [2.5], "tick": [2], "victim_request_id": [3], "blocks_freed": [12],
                            "reason": ["kv exhausted"]})
    levers = pd.DataFrame({"t_ms": [2.7], "tick": [2], "name": ["bisect_no_mix"], "old": [False],
                           "new": [True], "status": ["applied"]})
    spec = _spec(timeline_figure(_forwards(3), streams, links, preempt, levers))
    by_name = {t["name"]: t for t in spec["data"]}
    assert by_name["stream record"]["y"] == [LANE_Y["prefill"]]
    assert by_name["stream wait"]["marker"]["symbol"] == "square"
    assert by_name["stream wait"]["y"] == [LANE_Y["default"]]   # drawn on the stream made to wait
    assert by_name["record → wait"]["x"] == [0.001, 0.002, None]
    assert by_name["record → wait"]["y"] == [LANE_Y["prefill"], LANE_Y["default"], None]
    assert by_name["GPU-timed interval"]["base"] == [pytest.approx(0.0002)]
    assert by_name["GPU-timed interval"]["x"] == [pytest.approx(0.0008)]
    assert by_name["preemption"]["y"] == [LANE_Y["events"]] and by_name["preemption"]["customdata"][0][1] == 3
    assert by_name["lever change"]["text"] == ["bisect_no_mix: False → True (applied at tick 2)"]
    assert spec["layout"]["yaxis"]["ticktext"][LANE_Y.__len__() - 1 - int(LANE_Y["scheduler"])] == "scheduler"


def test_timeline_labels_lever_lines_fixes_marker_colours_and_states_a_cap():
    forwards = _forwards(3).assign(cap_rule=["max_prefill_tokens", "ssm_tail", None],
                                   mix_blocker=[None, "bisect_no_mix", None])
    streams = pd.DataFrame({"t_ms": [1.0, 2.0], "kind": ["record", "wait"], "stream": ["prefill", "default"],
                            "event_name": ["a", "a"], "seq": [1, 1], "tick": [0, 0], "gpu_elapsed_ms": [None, None],
                            "target_stream": [None, "default"]})
    levers = pd.DataFrame({"t_ms": [2.7, 3.1], "tick": [2, 3], "name": ["bisect_no_mix", "max_prefill_tokens"],
                           "old": ["false", "256"], "new": ["true", "-5"], "status": ["applied", "rejected"]})
    spec = _spec(timeline_figure(forwards, streams, NO_LINKS, NO_PREEMPT, levers, stream_events_cap=1500))
    lines = [s for s in spec["layout"].get("shapes", []) if s["type"] == "line"]
    assert [line["x0"] for line in lines] == [pytest.approx(0.0027)]   # applied changes only
    texts = [a["text"] for a in spec["layout"]["annotations"]]
    assert "bisect_no_mix=true" in texts
    assert any("only the newest 1,500" in t for t in texts)
    by_name = {t["name"]: t for t in spec["data"]}
    assert by_name["stream record"]["marker"]["color"] != by_name["stream wait"]["marker"]["color"]
    colours = {by_name["stream record"]["marker"]["color"], by_name["stream wait"]["marker"]["color"]}
    assert not colours & {"#ff7f0e", "#7b3fe4", "#d62728"}          # lever, mixed, preemption
    mixed = by_name["mixed forward"]
    assert mixed["text"][0].startswith("cap rule max_prefill_tokens · mix blocker none")
    assert "%{text}" in mixed["hovertemplate"]
    prefill = by_name["prefill forward"]
    assert prefill["text"][0].startswith("cap rule ssm_tail · mix blocker bisect_no_mix")


def test_latency_figure_groups_percentiles():
    lat = pd.DataFrame({"metric": ["TTFT", "ITL", "e2e"], "p50_ms": [10.0, 2.0, 50.0],
                        "p90_ms": [20.0, 3.0, 80.0], "p99_ms": [40.0, 9.0, 120.0], "count": [5, 90, 5]})
    spec = _spec(charts.latency_figure(lat))
    assert [t["name"] for t in spec["data"]] == ["p50", "p90", "p99"]
    assert spec["data"][2]["y"] == [40.0, 9.0, 120.0]


def test_chunk_histogram_bins_centered_and_stacked_by_path():
    bins = pd.DataFrame({"bin_start": [0, 64, 0], "bin_width": [64, 64, 64], "path": ["mixed", "mixed", "prefill"],
                         "count": [3, 1, 2]})
    spec = _spec(charts.chunk_length_histogram(bins))
    mixed = next(t for t in spec["data"] if t["name"] == "mixed")
    assert mixed["x"] == [32.0, 96.0] and mixed["y"] == [3, 1]
    assert spec["layout"]["barmode"] == "stack"


def test_mix_share_is_percent_normalised():
    share = pd.DataFrame({"bucket_s": [0, 1], "num_mixed": [3, 0], "num_plain": [1, 2]})
    spec = _spec(charts.mix_share_figure(share))
    assert spec["layout"]["barnorm"] == "percent"
    assert spec["data"][0]["y"] == [3, 0] and spec["data"][1]["y"] == [1, 2]


def test_waterfall_spans_and_end_markers():
    phases = pd.DataFrame({
        "request_id": [1, 1, 1, 1, 2, 2],
        "phase": ["queued", "prefilling", "decoding", "finished", "queued", "error"],
        "start_ms": [0.0, 5.0, 9.0, 30.0, 1.0, 4.0], "end_ms": [5.0, 9.0, 30.0, 30.0, 4.0, 4.0],
        "detail": [None, None, None, "eos", None, "kv allocation failed"]})
    spec = _spec(charts.waterfall_figure(phases))
    by_name = {t["name"]: t for t in spec["data"]}
    assert by_name["queued"]["y"] == ["req 1", "req 2"] and by_name["queued"]["x"] == [5.0, 3.0]
    assert by_name["decoding"]["base"] == [9.0]
    assert by_name["finished"]["type"] == "scatter" and by_name["finished"]["x"] == [30.0]
    assert by_name["error"]["customdata"] == [["kv allocation failed"]]


def test_runs_compare_one_trace_per_run():
    metrics = pd.DataFrame({"run": ["run 1", "run 1", "run 2", "run 2"], "metric": ["TTFT p50", "ITL p50"] * 2,
                            "value_ms": [10.0, 2.0, 12.0, 2.5]})
    spec = _spec(charts.runs_compare_figure(metrics))
    assert [t["name"] for t in spec["data"]] == ["run 1", "run 2"]
    assert spec["data"][1]["y"] == [12.0, 2.5]


def test_timeline_roofline_lane_colours_each_forward_by_its_share():
    forwards = _forwards(6).assign(roofline_share=[0.1, 0.5, None, 0.9, 0.25, 0.75])
    spec = _spec(timeline_figure(forwards, NO_STREAMS, NO_LINKS, NO_PREEMPT, NO_LEVERS))
    lane = next(t for t in spec["data"] if t["name"] == "roofline share")
    assert lane["type"] == "scatter"
    # log10 of each share (the forward without a roofline is left out); the hover says the share itself
    assert lane["marker"]["color"] == pytest.approx(np.log10([0.1, 0.5, 0.9, 0.25, 0.75]).tolist())
    assert lane["text"] == ["10.0%", "50.0%", "90.0%", "25.0%", "75.0%"]
    assert lane["x"][0] == 0.00075 and set(lane["y"]) == {LANE_Y["roofline"]}   # mid-forward, in its own lane
    assert lane["marker"]["cmin"] == -2 and lane["marker"]["cmax"] == 0
    assert lane["marker"]["colorbar"]["ticktext"] == ["1%", "3%", "10%", "30%", "100%"]
    assert "roofline" in spec["layout"]["yaxis"]["ticktext"]


def test_a_healthy_overhead_bound_run_is_not_painted_as_an_alarm():
    """A tiny model's forwards reach 2-7% of the roofline (issue 26): no colour of the lane's scale is
    an alarm red, and 2% and 7% sit in the scale's middle half, apart from each other."""
    from dashboard.figures.roofline_lane import ROOFLINE_COLORSCALE, roofline_color_values

    import plotly.colors

    for _, colour in ROOFLINE_COLORSCALE:
        red, green, blue = plotly.colors.hex_to_rgb(colour) if colour.startswith("#") else \
            plotly.colors.unlabel_rgb(colour)
        assert not (red > 1.5 * green and red > 1.5 * blue), colour
    low, high = roofline_color_values(np.array([0.02, 0.07]))
    assert -2 + 0.25 < low < high < -0.5   # on a linear 0..100% scale both were within 7% of the bottom
    assert roofline_color_values(np.array([0.001, 1.4])).tolist() == [-2, 0]


def test_timeline_roofline_lane_goes_webgl_and_handles_runs_without_rooflines():
    many = _forwards(WEBGL_THRESHOLD + 3)
    spec = _spec(timeline_figure(many.assign(roofline_share=0.4), NO_STREAMS, NO_LINKS, NO_PREEMPT, NO_LEVERS))
    lane = next(t for t in spec["data"] if t["name"] == "roofline share")
    assert lane["type"] == "scattergl" and len(lane["x"]) == WEBGL_THRESHOLD + 3
    none = _spec(timeline_figure(_forwards(6).assign(roofline_share=None), NO_STREAMS, NO_LINKS, NO_PREEMPT,
                                 NO_LEVERS))
    assert all(t["name"] != "roofline share" for t in none["data"])


def test_the_live_pages_unvalidated_timeline_json_is_the_validated_figure(real_run_dir):
    """The Live page serializes the timeline dict without graph-object validation (that took most of a
    refresh); on a real run's window, plus rank lanes and a stated cap, the browser gets exactly what the
    validated ``go.Figure`` would send."""
    from dashboard.queries.live import timeline_window
    from dashboard.figures.timeline import timeline_json

    win = timeline_window(real_run_dir.db, int(real_run_dir.one("SELECT MAX(run_id) FROM runs")), 3600.0)
    assert len(win.forwards) and len(win.lever_changes)          # real bars, roofline and lever lines
    ranks = pd.DataFrame({"rank": [0, 1], "tick": [1, 1], "start_ms": [1.0, 1.0], "broadcast_ms": [0.1, 0.2],
                          "expert_ms": [0.3, 0.4], "exchange_ms": [0.05, 0.06], "forward_ms": [0.9, 0.9]})
    args = (win.forwards, win.stream_events, win.links, win.preemptions, win.lever_changes,
            (win.start_ms, win.end_ms))
    kwargs = dict(stream_events_cap=1500, kv_quant_changes=win.kv_quant_changes, rank_forwards=ranks)
    fast = decode_spec(timeline_json(*args, **kwargs))
    validated = _spec(timeline_figure(*args, **kwargs))
    assert fast["data"] == validated["data"]
    assert fast["layout"] == validated["layout"]
    assert any(t["name"] == "roofline share" for t in fast["data"])
    assert [s["type"] for s in fast["layout"]["shapes"]] == ["line"] * len(fast["layout"]["shapes"]) != []


def test_a_blocked_spell_is_a_bar_and_a_band_with_its_length_and_blocker():
    """Ticks stop while the engine is blocked: the spell is drawn on the events lane and behind every
    lane (issue 29, item 4), in seconds like the rest of the axis."""
    stalls = pd.DataFrame({"start_ms": [4.0, 5000.0], "end_ms": [2004.0, 70000.0],
                           "blocker": ["head request 3 needs 9 KV blocks, cap is 8", "x"], "is_open": [False, True]})
    spec = _spec(timeline_figure(_forwards(3), NO_STREAMS, NO_LINKS, NO_PREEMPT, NO_LEVERS, stalls=stalls))
    bar = next(t for t in spec["data"] if t["name"].startswith("blocked"))
    assert bar["base"] == [0.004, 5.0] and bar["x"] == [2.0, 65.0] and set(bar["y"]) == {LANE_Y["events"]}
    assert bar["text"] == ["blocked 2.0 s: head request 3 needs 9 KV blocks, cap is 8",
                           "blocked 65.0 s (still blocked): x"]
    bands = [s for s in spec["layout"]["shapes"] if s["type"] == "rect"]
    assert [(b["x0"], b["x1"]) for b in bands] == [(0.004, 2.004), (5.0, 70.0)]
    assert {a["text"] for a in spec["layout"]["annotations"]} >= set(bar["text"])
