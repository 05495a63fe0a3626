"""Replay of a production request trace: arrival times and lengths from a CSV.

The reference trace is the Azure LLM inference trace 2023, conversation
service (``azure_conv_2023.csv``: TIMESTAMP, ContextTokens, GeneratedTokens;
19,366 requests over about an hour), published in Azure/AzurePublicDataset
under CC-BY with P. Patel et al., "Splitwise: Efficient Generative LLM
Inference Using Phase Splitting", ISCA 2024.

The trace carries lengths, not text, so prompts are seeded random token ids.
A small machine replays it scaled: ``time_scale`` multiplies every
inter-arrival gap (F < 1 compresses time, keeping the burst pattern) and
``length_scale`` multiplies prompt and output lengths (never below 1,
keeping their ratio). ``describe()`` reports both so the run row says
what was replayed.
"""
from __future__ import annotations

import csv
import random
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Iterator

from engine.workload.request import (
    RequestSpec,
    TokenDrawer,
    WorkloadError,
    check_positive,
    check_sampling_mix,
    greedy_sampling,
    length_summary,
    mixed_sampling,
)

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_CONV_2023 = "azure_conv_2023.csv"
AZURE_CITATION = ("Azure LLM inference trace 2023, conversation service (Azure/AzurePublicDataset, CC-BY); "
                  "Patel et al., Splitwise, ISCA 2024")


def read_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """(seconds since the first row, context tokens, generated tokens) per row."""
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"trace {path}: cannot open ({exc.strerror or exc})") from None
    rows: list[tuple[float, int, int]] = []
    with handle:
        reader = csv.reader(handle, skipinitialspace=True)
        header = [name.strip() for name in next(reader, [])]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise WorkloadError(f"trace {path}: missing column {missing[0]!r} (header: {header})")
        index = [header.index(c) for c in COLUMNS]
        first: datetime | None = None
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                stamp, context, generated = (row[i].strip() for i in index)
            except IndexError:
                raise WorkloadError(f"trace {path} line {line_no}: {len(row)} fields, expected {len(header)}") from None
            when = _parse_time(path, line_no, stamp)
            first = when if first is None else first
            rows.append(((when - first).total_seconds(),
                         _parse_count(path, line_no, "ContextTokens", context),
                         _parse_count(path, line_no, "GeneratedTokens", generated)))
    if not rows:
        raise WorkloadError(f"trace {path}: no request rows after the header")
    return rows


def _parse_time(path: Path, line_no: int, text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise WorkloadError(f"trace {path} line {line_no}: TIMESTAMP {text!r} is not an ISO date-time") from None


def _parse_count(path: Path, line_no: int, column: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise WorkloadError(f"trace {path} line {line_no}: {column} {text!r} is not an integer") from None
    if value < 0:
        raise WorkloadError(f"trace {path} line {line_no}: {column} {value} is negative")
    return value


class TraceWorkload:
    def __init__(
        self,
        path: str | Path,
        *,
        vocab_size: int,
        excluded_ids: Iterable[int] = (),
        time_scale: float = 1.0,
        length_scale: float = 1.0,
        start: int = 0,
        limit: int | None = None,
        max_prompt_len: int | None = None,
        greedy_fraction: float = 1.0,
        seed: int = 0,
    ):
        check_positive("time_scale", time_scale)
        check_positive("length_scale", length_scale)
        check_positive("start", start, allow_zero=True, integer=True)
        if limit is not None:
            check_positive("limit", limit, integer=True)
        if max_prompt_len is not None:
            check_positive("max_prompt_len", max_prompt_len, integer=True)
        check_sampling_mix(greedy_fraction, seed)
        self.path = Path(path)
        rows = read_trace(self.path)
        if start >= len(rows):
            raise WorkloadError(f"trace {self.path}: start {start} is past its {len(rows)} rows")
        self.num_trace_rows = len(rows)
        self.rows = rows[start:] if limit is None else rows[start:start + limit]
        self.tokens = TokenDrawer(vocab_size, excluded_ids)
        self.time_scale, self.length_scale = float(time_scale), float(length_scale)
        self.start, self.limit, self.max_prompt_len = start, limit, max_prompt_len
        self.greedy_fraction, self.seed = greedy_fraction, seed

    def scaled_len(self, num_tokens: int) -> int:
        return max(1, round(num_tokens * self.length_scale))

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests())

    def requests(self) -> list[RequestSpec]:
        rng = random.Random(f"{self.seed}:trace")
        t0 = self.rows[0][0]
        specs = []
        for i, (offset_s, context, generated) in enumerate(self.rows):
            prompt_len = self.scaled_len(context)
            if self.max_prompt_len is not None:
                prompt_len = min(prompt_len, self.max_prompt_len)
            output_len = self.scaled_len(generated)
            sampling = (greedy_sampling(output_len) if self.greedy_fraction >= 1
                        else mixed_sampling(rng, output_len, self.greedy_fraction))
            specs.append(RequestSpec(
                request_id=i,
                # Scaling offsets from the slice start scales every gap by the same factor.
                arrival_s=(offset_s - t0) * self.time_scale,
                prompt_tokens=self.tokens.draw(rng, prompt_len),
                sampling=sampling,
            ))
        return specs

    def describe(self) -> dict[str, Any]:
        described = {
            "kind": "trace",
            "path": str(self.path),
            "time_scale": self.time_scale,
            "length_scale": self.length_scale,
            "start": self.start,
            "limit": self.limit,
            "max_prompt_len": self.max_prompt_len,
            "greedy_fraction": self.greedy_fraction,
            "seed": self.seed,
            "num_trace_rows": self.num_trace_rows,
            "trace_duration_s": round(self.rows[-1][0] - self.rows[0][0], 6),
            **length_summary(self.requests()),
        }
        if self.path.name == AZURE_CONV_2023:
            described["source"] = AZURE_CITATION
        return described
