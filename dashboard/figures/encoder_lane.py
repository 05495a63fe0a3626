"""The Live timeline's encoder lane: vision-tower runs and encoder-cache hits, a pure DataFrame -> traces builder.

Each ``encoder_run`` event is a bar from its tick's start (the runner encodes a chunk's images
before its layers run) as long as the tower took; runs of one tick are drawn back to back. Each
``encoder_hit`` (an image's rows served from the cache) is a marker at its tick's start. Drawn
only when the run has such events (a checkpoint with a vision tower).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

ENCODER_COLUMNS = ["tick", "start_ms", "kind", "request_id", "tokens", "encoder_ms"]
RUN, HIT = "encoder_run", "encoder_hit"
LANE_NAME = "encoder"


def encoder_lane_traces(encoder: pd.DataFrame, y: float) -> list[dict]:
    """Bars for the runs and markers for the hits (plain Plotly trace dicts) on the lane at ``y``."""
    if encoder.empty:
        return []
    traces = []
    runs = encoder[encoder["kind"] == RUN]
    if not runs.empty:
        widths = runs["encoder_ms"].to_numpy(dtype=float)
        # Runs of one tick back to back: each starts where the tick's previous runs ended.
        before = runs.groupby("tick")["encoder_ms"].cumsum().to_numpy(dtype=float) - widths
        custom = runs[["tick", "request_id", "tokens", "encoder_ms"]].to_numpy(dtype=float)
        traces.append(dict(type="bar", name="encoder run", orientation="h", y=np.full(len(runs), y),
                           base=runs["start_ms"].to_numpy(dtype=float) + before, x=widths, width=0.5,
                           marker={"color": "#9467bd"}, customdata=custom,
                           hovertemplate="tick %{customdata[0]} · request %{customdata[1]}<br>tower ran over "
                                         "%{customdata[2]} image rows in %{customdata[3]:.3f} ms<extra></extra>"))
    hits = encoder[encoder["kind"] == HIT]
    if not hits.empty:
        custom = hits[["tick", "request_id", "tokens"]].to_numpy(dtype=float)
        traces.append(dict(type="scatter", mode="markers", name="encoder cache hit", y=np.full(len(hits), y),
                           x=hits["start_ms"].to_numpy(dtype=float), marker={"symbol": "diamond", "size": 8,
                                                                             "color": "#17becf"},
                           customdata=custom, hovertemplate="tick %{customdata[0]} · request %{customdata[1]}<br>"
                                                            "%{customdata[2]} image rows from the encoder cache"
                                                            "<extra></extra>"))
    return traces


def empty_encoder_events() -> pd.DataFrame:
    return pd.DataFrame({"tick": np.array([], dtype=float), "start_ms": np.array([], dtype=float),
                         "kind": np.array([], dtype=object), "request_id": np.array([], dtype=float),
                         "tokens": np.array([], dtype=float), "encoder_ms": np.array([], dtype=float)})
