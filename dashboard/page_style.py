"""Style the dashboard sets on every page, for what Streamlit's widgets do not offer as an option.

A multi-select keeps its chips on one line inside a fixed 40 px box and scrolls them sideways under a
fading edge: with two blockers picked on Chunks only one chip could be seen while both filtered
(issue 29, item 6). Here the chips wrap and the box grows, so every picked value is in view.
"""
from __future__ import annotations

import streamlit as st

CHIPS_WRAP_CSS = """<style>
[data-testid="stMultiSelectTagsContainer"] {
  flex-wrap: wrap !important; height: auto !important; overflow: visible !important; mask-image: none !important;
}
.stMultiSelect .react-aria-ComboBox > [role="group"] { height: auto !important; max-height: none !important; }
</style>"""


def apply() -> None:
    st.html(CHIPS_WRAP_CSS)     # style only: Streamlit adds it to the page without a visible element
