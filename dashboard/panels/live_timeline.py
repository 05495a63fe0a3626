"""Draw the Live timeline in a frame that stays mounted across fragment reruns.

``st.plotly_chart`` hashes the figure spec into the element's identity
(``key_as_main_identity=False`` in Streamlit 1.67) and the frontend keys the
chart's React component on that identity. A live figure changes every second,
so every refresh unmounted the chart and drew a fresh Plotly graph: the DOM
node was replaced (a blank instant), hover was lost, a drag in progress was
cut off, and the user's zoom was reset, whatever ``uirevision`` said.

A keyed custom component keeps one identity (name + key) for its whole life.
Its frame (``timeline_frontend/index.html``) receives each new figure as an
argument and updates the same graph with ``Plotly.react``, re-applying the
user's zoom until they double-click back to the live window. plotly.js comes
from the installed ``plotly`` package, served by a second, asset-only
component, so nothing is copied and nothing is fetched from the internet.
"""
from __future__ import annotations

from pathlib import Path

import plotly
import plotly.graph_objects as go
import streamlit.components.v1 as components

FRONTEND_DIR = Path(__file__).parent / "timeline_frontend"
PLOTLY_JS_DIR = Path(plotly.__file__).parent / "package_data"

_frame = components.declare_component("live_timeline", path=str(FRONTEND_DIR))
# Serves plotly.min.js (and nothing of ours) at /component/<this name>/plotly.min.js.
_plotly_js = components.declare_component("plotly_js", path=str(PLOTLY_JS_DIR))


def render(fig: go.Figure | str, *, key: str, revision: int) -> dict | None:
    """Send ``fig`` (a figure or its Plotly JSON) to the mounted timeline frame; ``revision`` tags the drawn figure (``data-revision``).

    ``key`` must stay the same across reruns: it is the frame's whole identity. Returns the last
    click on a forward (``{"request_id", "tick", "clicked_at"}``), or None before any click.
    """
    if not (PLOTLY_JS_DIR / "plotly.min.js").is_file():
        raise FileNotFoundError(f"plotly.min.js is missing from the plotly package at {PLOTLY_JS_DIR}")
    return _frame(spec=fig if isinstance(fig, str) else fig.to_json(), plotly_component=_plotly_js.name, revision=int(revision),
           key=key, default=None)
