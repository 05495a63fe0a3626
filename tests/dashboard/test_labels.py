"""Labels that say what is true: the latency scope of a young run, the waterfall's zoomable time axis."""
from __future__ import annotations

import pandas as pd
from plotly_spec import spec as decode_spec

from dashboard.figures import charts
from dashboard.queries import live as queries_live


def test_latency_scope_of_a_run_smaller_than_the_cap_names_its_size(run_fixture):
    latency = queries_live.latency_percentiles(run_fixture.db, run_fixture.run1, is_recent=True)
    num = len(run_fixture.final_requests())
    assert latency["scope"].iloc[0] == f"all {num:,} requests so far"


def test_waterfall_has_a_zoomable_time_axis_and_readable_bars():
    phases = pd.DataFrame({"request_id": [1, 1, 1], "phase": ["queued", "prefilling", "decoding"],
                           "start_ms": [0.0, 2.0, 5.0], "end_ms": [2.0, 5.0, 300_000.0], "detail": ["", "", ""]})
    spec = decode_spec(charts.waterfall_figure(phases).to_json())
    assert spec["layout"]["xaxis"]["rangeslider"]["visible"] is True
    assert all(t.get("width") == 0.8 for t in spec["data"] if t["type"] == "bar")
