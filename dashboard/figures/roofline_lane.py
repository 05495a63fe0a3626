"""The Live timeline's roofline lane: one marker per forward (or time bucket), coloured by how close
it came to what the machine allows (its roofline share, engine/model/roofline.py)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.colors

# The roofline lane's colour: a sequential scale with no alarm red (dark: far from what the machine
# allows, bright: at the roofline), over log10 of the share from 1% to 100%. A small model on a CPU is
# overhead-bound (dispatch and Python time dwarf its few MFLOPs), so 2-7% is a healthy tiny run, and a
# red-to-green scale painted every one of its bars as an alarm (issue 26); on a log scale a forward far
# from its neighbours stands out at any level. (Resolved to stops here, as graph-object validation
# would: the dict goes to the browser unvalidated.)
ROOFLINE_COLORSCALE = plotly.colors.get_colorscale("Viridis")
ROOFLINE_SHARE_TICKS = (0.01, 0.03, 0.1, 0.3, 1.0)


def roofline_trace(forwards: pd.DataFrame, webgl: bool, lane_y: float) -> list:
    """One marker per forward (or time bucket) in the roofline lane, coloured by its roofline share.

    The share is roofline time / measured time (engine/model/roofline.py): how close that
    forward came to what the machine allows. Forwards without a recorded roofline are left out.
    """
    if "roofline_share" not in forwards.columns:
        return []
    rows = forwards[forwards["roofline_share"].notna()]
    if rows.empty:
        return []
    end = rows["end_ms"] if "end_ms" in rows.columns else rows["start_ms"] + rows["dur_ms"]
    share = rows["roofline_share"].to_numpy(dtype=float)
    low, high = ROOFLINE_SHARE_TICKS[0], ROOFLINE_SHARE_TICKS[-1]
    return [dict(
        type="scattergl" if webgl else "scatter", name="roofline share",
        x=((rows["start_ms"] + end) / 2).to_numpy(dtype=float),
        y=np.full(len(rows), lane_y), mode="markers", customdata=rows[["path"]].astype(str).to_numpy(),
        text=[f"{value:.1%}" for value in share],
        marker={"symbol": "square", "size": 10, "color": roofline_color_values(share),
                "colorscale": ROOFLINE_COLORSCALE, "cmin": float(np.log10(low)), "cmax": float(np.log10(high)),
                "colorbar": {"title": {"text": "roofline"}, "len": 0.5, "thickness": 10,
                             "tickvals": [float(np.log10(t)) for t in ROOFLINE_SHARE_TICKS],
                             "ticktext": [f"{t:.0%}" for t in ROOFLINE_SHARE_TICKS]}},
        hovertemplate="%{customdata[0]} forward reached %{text} of its roofline<extra></extra>",
    )]


def roofline_color_values(share: np.ndarray) -> np.ndarray:
    """The lane's colour values: log10 of each share, held to the scale's 1%..100% (a share above 1
    is a probe that caught the machine in a slow moment; it reads as at the roofline)."""
    low, high = ROOFLINE_SHARE_TICKS[0], ROOFLINE_SHARE_TICKS[-1]
    return np.log10(np.clip(share, low, high))
