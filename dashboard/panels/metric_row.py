"""A row of ``st.metric`` that wraps instead of cutting labels and values with "…".

``st.columns`` gives every metric an equal share of the page: ten counters on a
1280 px window left ~70 px each, and "active (decoding)" or "0.0 / 0.4" were cut
to "activ…" / "0.…". A horizontal container sizes each metric to its content and
moves what does not fit onto the next line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import streamlit as st


@dataclass(frozen=True)
class Metric:
    label: str
    value: Any
    help: str | None = None


def metric_row(metrics: Sequence[Metric]) -> None:
    row = st.container(horizontal=True, gap="medium")
    for m in metrics:
        row.metric(m.label, m.value, help=m.help, width="content")
