"""The Live timeline's blocked spells: when no step was possible (a KV cap no request fits under,
an SSM pool too small), the time between the engine's ``stalled`` and ``stall_cleared`` events.

Ticks stop while the engine is blocked, so without this the timeline ended at the last forward and
the stall (and the lever change that caused it) fell out of the picture. Each spell is a bar on the
events lane (its hover names the blocker) and a faint band behind every lane, labelled with its
length. Times in ms since run start, like the rest of the timeline's rows.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

BLOCKED_COLOR = "rgba(214,39,40,0.35)"
BLOCKED_BAND = "rgba(214,39,40,0.08)"
BLOCKED_NAME = "blocked (no step possible)"
MAX_LABEL = 80


def stall_band(stalls: pd.DataFrame | None, lane_y: float) -> tuple[list[dict], list[dict], list[dict]]:
    """(traces, shapes, annotations) for each spell the engine was blocked: a bar on the events lane
    (hover: the blocker), a band behind every lane and its length, so a stall stays in the picture
    after the last forward."""
    if stalls is None or not len(stalls):
        return [], [], []
    start, end = stalls["start_ms"].to_numpy(dtype=float), stalls["end_ms"].to_numpy(dtype=float)
    text = [f"blocked {(e - b) / 1000:.1f} s{' (still blocked)' if is_open else ''}: {blocker}"
            for b, e, blocker, is_open in zip(start, end, stalls["blocker"].astype(str), stalls["is_open"])]
    trace = dict(type="bar", name=BLOCKED_NAME, y=np.full(len(stalls), lane_y),
                 base=start, x=end - start, orientation="h", width=0.8, marker={"color": BLOCKED_COLOR},
                 text=text, textposition="none", hovertemplate="%{text}<extra></extra>")
    shapes = [{"type": "rect", "x0": b, "x1": e, "xref": "x", "y0": 0, "y1": 1, "yref": "y domain",
               "fillcolor": BLOCKED_BAND, "line": {"width": 0}, "layer": "below"} for b, e in zip(start, end)]
    annotations = [{"x": b, "xref": "x", "y": 0, "yref": "y domain", "showarrow": False, "xanchor": "left",
                    "yanchor": "bottom", "text": label[:MAX_LABEL], "font": {"size": 10, "color": "#d62728"}}
                   for b, label in zip(start, text)]
    return [trace], shapes, annotations
