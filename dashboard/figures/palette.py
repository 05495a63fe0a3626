"""Colours and marker symbols shared by every chart, so a path looks the same on every page."""
from __future__ import annotations

PATH_COLORS = {
    "mixed": "#7b3fe4",
    "prefill": "#1f77b4",
    "decode": "#2ca02c",
    "idle": "#c7c7c7",
}
PHASE_COLORS = {
    "queued": "#bdbdbd",
    "prefilling": "#1f77b4",
    "decoding": "#2ca02c",
    "preempted": "#d62728",
    "finished": "#2b2b2b",
    "error": "#ff0000",
    "cancelled": "#e377c2",
}
SPEC_KIND_COLORS = {"ngram": "#ff7f0e", "mtp": "#9467bd", "self": "#17becf"}
KIND_SYMBOLS = {"record": "triangle-up", "wait": "square", "sync": "circle"}
# Fixed per kind (Plotly's colour cycle would repaint them as traces come and go between frames),
# and apart from the path colours, the lever-change orange and the preemption red.
KIND_COLORS = {"record": "#17becf", "wait": "#8c6d31", "sync": "#636363"}
LEVER_COLOR = "#ff7f0e"
FALLBACK_COLOR = "#8c564b"


def path_color(path: object) -> str:
    return PATH_COLORS.get(str(path), FALLBACK_COLOR)


def phase_color(phase: object) -> str:
    return PHASE_COLORS.get(str(phase), FALLBACK_COLOR)


def spec_kind_color(kind: object) -> str:
    return SPEC_KIND_COLORS.get(str(kind), FALLBACK_COLOR)
