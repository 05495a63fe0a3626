"""Every table on the dashboard goes through ``show``: column widths sized to what the cells hold.

``st.dataframe`` draws on a canvas (glide data grid) and gives each column a
width of its own guess, which cut headers like "prefix miss reason" and values
like "max_prefill_tokens" with "…" (issue 19, item 15). ``column_widths`` is a
pure decision: for every column (and a shown index), the widest of its header
and the cell texts it holds, in pixels at the grid's 14 px font, clamped to
``[MIN_PX, MAX_PX]``; ``show`` passes those widths in ``column_config``,
keeping any label, format or explicit width a page already set. A cell longer
than ``MAX_PX`` (an error message) keeps the "…" and shows in full on hover.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import pandas as pd
import streamlit as st

CHAR_PX = 8.0        # a character of the grid's 14 px sans-serif font, rounded up (digits and capitals)
PAD_PX = 36          # cell padding both sides, plus the header's sort / menu affordance
MIN_PX = 60
MAX_PX = 560
ROW_PX = 35          # the grid's row (and header) height at the default density
ALL_ROWS_UP_TO = 30  # a table this short shows every row: the grid's own default height shows ~10 and
# hid the Levers tables' last rows without a hint (issue 29, item 5); longer tables scroll
SAMPLE_ROWS = 2_000  # the widest value among this many rows (tables here show at most a few thousand)
INDEX_KEY = "_index"


def text_px(text: str) -> int:
    """Pixels a header or cell of ``text`` needs to show without "…"."""
    return int(len(text) * CHAR_PX) + PAD_PX


def _config_dict(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, str):           # st.dataframe accepts a bare label
        return {"label": config}
    return dict(config)


def _cell_texts(values: pd.Series, config: dict) -> pd.Series:
    """What the grid shows for each value: str(value), or a link column's display_text capture."""
    texts = values.head(SAMPLE_ROWS).dropna().astype(str)
    pattern = (config.get("type_config") or {}).get("display_text")
    if pattern:
        try:
            regex = re.compile(pattern)
        except re.error:
            return texts
        texts = texts.map(lambda t: (m.group(1) if m and m.groups() else m.group(0)) if (m := regex.search(t))
                          else t)
    return texts


def column_width(header: str, values: pd.Series, config: dict) -> int:
    """The column's width in pixels: its header or its widest shown cell, clamped."""
    texts = _cell_texts(values, config)
    widest = max([len(header), *(texts.str.len().tolist() or [0])])
    return max(MIN_PX, min(MAX_PX, text_px("x" * widest)))


def column_widths(frame: pd.DataFrame, column_config: Mapping[str, Any] | None = None,
                  *, hide_index: bool = True) -> dict[str, dict]:
    """``column_config`` for ``frame`` with a pixel ``width`` on every column (and the index when shown).

    Widths a page set explicitly are kept; everything else the page configured is passed through.
    """
    given = {name: _config_dict(cfg) for name, cfg in (column_config or {}).items()}
    out = dict(given)
    for name in frame.columns:
        key = str(name)
        cfg = dict(given.get(key, {}))
        if cfg.get("width") is None:
            cfg["width"] = column_width(str(cfg.get("label") or key), frame[name], cfg)
        out[key] = cfg
    if not hide_index:
        cfg = dict(given.get(INDEX_KEY, {}))
        if cfg.get("width") is None:   # every level of a MultiIndex is a grid column of this width
            levels = frame.index.to_frame(index=False)
            cells = pd.concat([levels[c].astype(str) for c in levels.columns], ignore_index=True)
            header = max((str(n) for n in frame.index.names if n is not None), key=len, default="")
            cfg["width"] = column_width(header, cells, cfg)
        out[INDEX_KEY] = cfg
    return out


def full_height(num_rows: int) -> int | None:
    """Pixels that show the header and every one of ``num_rows`` rows, for a table of at most
    ``ALL_ROWS_UP_TO`` rows; None (the grid's default, a scrolled box) for a longer one."""
    return ROW_PX * (num_rows + 1) + 3 if num_rows <= ALL_ROWS_UP_TO else None


def columns_past(widths: Mapping[str, dict], columns: list[str], budget_px: int) -> list[str]:
    """The columns, in order, that start past ``budget_px``: what a window that wide shows only after
    a sideways scroll (the page names them in a caption)."""
    left, past = 0, []
    for name in columns:
        left += int(widths.get(name, {}).get("width") or MIN_PX)
        if left > budget_px:
            past.append(name)
    return past


def show(frame: pd.DataFrame, *, key: str, column_config: Mapping[str, Any] | None = None,
         hide_index: bool = True, where: Any = None, **kwargs: Any) -> Any:
    """``st.dataframe`` (or ``where.dataframe``: a column, the sidebar) with content-sized columns,
    as tall as its rows when it has at most ``ALL_ROWS_UP_TO``."""
    target = st if where is None else where
    if kwargs.get("height") is None and (height := full_height(len(frame))) is not None:
        kwargs["height"] = height
    return target.dataframe(frame, hide_index=hide_index, key=key,
                            column_config=column_widths(frame, column_config, hide_index=hide_index), **kwargs)


# The table area of the main column at a 1280 px window with the sidebar open (measured in chromium by
# tests/dashboard/test_browser_newcomer.py): the columns a page leads with must fit in it.
VIEW_PX_1280 = 818


def show_wide(frame: pd.DataFrame, *, key: str, column_config: Mapping[str, Any] | None = None,
              **kwargs: Any) -> Any:
    """``show``, then a caption naming the columns a 1280 px window shows only after a sideways
    scroll, so nothing is hidden without a hint."""
    shown = show(frame, key=key, column_config=column_config, **kwargs)
    widths = column_widths(frame, column_config)
    past = columns_past(widths, [str(c) for c in frame.columns], VIEW_PX_1280)
    if past:
        labels = [str(widths[c].get("label") or c) for c in past]
        st.caption(f"Scroll the table sideways for {', '.join(labels)}.")
    return shown
