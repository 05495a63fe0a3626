"""Read a Plotly figure spec as the browser gets it: typed arrays ("bdata") decoded to lists."""
import base64
import json
import math

import numpy as np

_DTYPES = {"f8": "<f8", "f4": "<f4", "i1": "<i1", "u1": "<u1", "i2": "<i2", "u2": "<u2", "i4": "<i4", "u4": "<u4"}


def _decode(value):
    if isinstance(value, dict):
        if "bdata" in value and "dtype" in value:
            array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=_DTYPES[value["dtype"]])
            if "shape" in value:
                array = array.reshape([int(x) for x in str(value["shape"]).split(",")])
            return [_none_for_nan(x) for x in array.tolist()]
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _none_for_nan(x):
    if isinstance(x, list):
        return [_none_for_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def spec(json_text: str) -> dict:
    return _decode(json.loads(json_text))


def charts(at) -> list[dict]:
    """Every figure an AppTest page drew, decoded: st.plotly_chart specs and the Live timeline's."""
    specs = [c.proto.spec for c in at.get("plotly_chart")]
    # the Live timeline is drawn by its own keyed frame (dashboard/panels/live_timeline.py), spec in its args
    specs += [json.loads(c.proto.json_args)["spec"] for c in at.get("component_instance")]
    return [spec(s) for s in specs]


def chart_with(at, **layout) -> dict:
    for figure in charts(at):
        if all(figure["layout"].get(k) == v for k, v in layout.items()):
            return figure
    raise AssertionError(f"no chart with layout {layout}")


def texts(at) -> str:
    return " ".join(str(m.value) for m in list(at.markdown) + list(at.caption))
