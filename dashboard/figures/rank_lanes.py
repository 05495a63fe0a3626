"""Per-rank lanes of the Live timeline under expert parallelism: a pure DataFrame -> traces builder.

Each rank's share of each forward (``ep_forward`` events, gathered by rank 0 with the forward's
result) is drawn on its own lane below the stream lanes: the broadcast wait before the forward,
the forward, and inside it the rank's expert compute then its exchange time (summed over
layers, so drawn back to back rather than interleaved as they ran).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

RANK_COLUMNS = ["rank", "tick", "start_ms", "broadcast_ms", "expert_ms", "exchange_ms", "forward_ms"]
_PARTS = (  # (column, label, colour, bar width, offset from the forward start column)
    ("broadcast_ms", "rank broadcast", "rgba(120,120,120,0.55)", 0.5),
    ("forward_ms", "rank forward", "rgba(31,119,180,0.30)", 0.6),
    ("expert_ms", "rank experts", "#2ca02c", 0.35),
    ("exchange_ms", "rank exchange", "#d62728", 0.35),
)
_HOVER = ("rank %{customdata[0]} · tick %{customdata[1]}<br>broadcast %{customdata[2]:.3f} ms · forward "
          "%{customdata[3]:.3f} ms<br>experts %{customdata[4]:.3f} ms · exchange %{customdata[5]:.3f} ms"
          "<extra>%{fullData.name}</extra>")


def rank_lane_names(ranks: list[int]) -> list[str]:
    return [f"rank {r}" for r in ranks]


def rank_lane_traces(rank_forwards: pd.DataFrame, top_y: float) -> tuple[list[dict], list[float], list[str]]:
    """Bars (plain Plotly trace dicts) for every rank's forwards, lanes at ``top_y``, ``top_y - 1``, ...;
    returns (traces, y, names)."""
    if rank_forwards.empty:
        return [], [], []
    ranks = sorted(int(r) for r in rank_forwards["rank"].unique())
    lane_of = {rank: top_y - i for i, rank in enumerate(ranks)}
    y = rank_forwards["rank"].map(lane_of).to_numpy(dtype=float)
    start = rank_forwards["start_ms"].to_numpy(dtype=float)
    custom = rank_forwards[["rank", "tick", "broadcast_ms", "forward_ms", "expert_ms",
                            "exchange_ms"]].to_numpy(dtype=float)
    bases = {
        "broadcast_ms": start - rank_forwards["broadcast_ms"].to_numpy(dtype=float),
        "forward_ms": start,
        "expert_ms": start,
        "exchange_ms": start + rank_forwards["expert_ms"].to_numpy(dtype=float),
    }
    traces = [dict(type="bar", name=label, y=y, base=bases[column], x=rank_forwards[column].to_numpy(dtype=float),
                   orientation="h", marker={"color": colour}, width=width, customdata=custom, hovertemplate=_HOVER,
                   legendgroup="ranks")
              for column, label, colour, width in _PARTS]
    return traces, [lane_of[r] for r in ranks], rank_lane_names(ranks)


def empty_rank_forwards() -> pd.DataFrame:
    return pd.DataFrame({name: np.array([], dtype=float) for name in RANK_COLUMNS})
