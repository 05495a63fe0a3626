"""Issue 19, item 15: no table column cut with "…". Every ``st.dataframe`` goes through
``dashboard.tables.show``; on every page of a real engine run, each table's columns carry a pixel width
at least what their header and their widest cell need (``tables.text_px``), up to ``tables.MAX_PX``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from dashboard.panels import tables

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboard"
PAGES = ["live", "chunks", "requests", "levers", "runs"]


def _needed_px(header: str, values: pd.Series, config: dict) -> int:
    pattern = (config.get("type_config") or {}).get("display_text")
    texts = values.dropna().astype(str)
    if pattern:
        texts = texts.map(lambda t: m.group(1) if (m := re.search(pattern, t)) else t)
    return min(tables.MAX_PX, tables.text_px("x" * max([len(header), *texts.str.len().tolist()])))


@pytest.mark.parametrize("page", PAGES)
def test_every_table_column_is_as_wide_as_its_header_and_cells(real_app, page):
    at = real_app(page)
    frames = at.dataframe
    assert len(frames), f"the {page} page drew no table on a real run"
    for frame in frames:
        config = json.loads(frame.proto.columns or "{}")
        shown = frame.value
        for name in shown.columns:
            cfg = config.get(str(name), {})
            width = cfg.get("width")
            header = str(cfg.get("label") or name)
            assert isinstance(width, int), f"{page}: column {name!r} has no pixel width ({width!r})"
            assert width >= _needed_px(header, shown[name], cfg), \
                f"{page}: column {name!r} is {width} px, its header / cells need {_needed_px(header, shown[name], cfg)}"
        if not config.get(tables.INDEX_KEY, {}).get("hidden"):
            levels = shown.index.to_frame(index=False)      # each level is a grid column
            for level in levels.columns:
                assert config[tables.INDEX_KEY]["width"] >= _needed_px(str(level), levels[level], {}), \
                    f"{page}: index level {level!r} too narrow"


def test_column_widths_keep_what_a_page_set_and_size_the_rest():
    frame = pd.DataFrame({"cap_rule": ["max_prefill_tokens", "ssm_tail"], "n": [1, 22],
                          "request_id": ["http://x/?run=1&request=12345", "http://x/?run=1&request=7"]})
    widths = tables.column_widths(frame, {"n": {"label": "a much longer label"},
                                          "request_id": {"type_config": {"type": "link",
                                                                         "display_text": r"request=(\d+)$"}},
                                          "fixed": {"width": 99}})
    assert widths["cap_rule"]["width"] == tables.text_px("max_prefill_tokens")
    assert widths["n"] == {"label": "a much longer label", "width": tables.text_px("a much longer label")}
    assert widths["request_id"]["width"] == max(tables.MIN_PX, tables.text_px("request_id"))   # shows "12345"
    assert widths["fixed"] == {"width": 99}
    long = tables.column_widths(pd.DataFrame({"error": ["x" * 500]}))
    assert long["error"]["width"] == tables.MAX_PX


def test_no_page_calls_st_dataframe_directly():
    """One way to draw a table, so no new table slips back to the grid's own guess."""
    offenders = [f"{path.relative_to(DASHBOARD)}:{no}" for path in DASHBOARD.rglob("*.py") if path.name != "tables.py"
                 for no, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\.dataframe\(", line)]
    assert not offenders, offenders
