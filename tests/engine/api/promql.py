"""Enough PromQL to evaluate dashboard queries against two scrapes of /metrics (no Prometheus here).

Supported: selectors with ``=`` matchers and a range (``[5m]``: the window is the two scrapes),
``rate`` / ``increase`` over that window, instant gauges and counters, ``sum`` / ``avg`` /
``max`` with ``by (labels)`` before or after their argument, ``histogram_quantile`` (linear
interpolation inside the bucket, as Prometheus does), ``clamp_min``, number literals and
``+ - * /`` between vectors (matched on all labels) or with a scalar. A query outside this subset
raises ``ValueError``, so a dashboard edit the evaluator cannot read fails loudly.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset       # of (name, value) pairs
Vector = dict            # Labels -> float
_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e-?\d+)?)|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)|"
                    r"(?P<str>\"[^\"]*\")|(?P<range>\[[^\]]+\])|(?P<op>[(){},=/*+-]))")


@dataclass
class Scrape:
    """Samples by name -> {labels: value}, and the time the scrape was taken."""

    t: float
    samples: dict[str, Vector]

    @classmethod
    def parse(cls, text: str, t: float) -> "Scrape":
        samples: dict[str, Vector] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[Labels(s.labels.items())] = s.value
        return cls(t, samples)


def tokens(query: str) -> list[tuple[str, str]]:
    out, at = [], 0
    query = query.strip()
    while at < len(query):
        match = _TOKEN.match(query, at)
        if match is None or match.end() == at:
            raise ValueError(f"cannot read {query[at:at + 20]!r}")
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        at = match.end()
    return out


class Evaluator:
    def __init__(self, before: Scrape, after: Scrape, variables: dict[str, str]) -> None:
        self.before, self.after, self.variables = before, after, variables

    def evaluate(self, query: str) -> Vector | float:
        for name, value in self.variables.items():
            query = query.replace(f"${name}", value)
        self._tokens, self._at = tokens(query), 0
        result = self._expr()
        if self._at != len(self._tokens):
            raise ValueError(f"unread input at {self._tokens[self._at:]}")
        return result

    # ---- parsing, evaluating as it goes ------------------------------------------------------
    def _peek(self) -> tuple[str, str] | None:
        return self._tokens[self._at] if self._at < len(self._tokens) else None

    def _take(self, value: str | None = None) -> tuple[str, str]:
        token = self._peek()
        if token is None or (value is not None and token[1] != value):
            raise ValueError(f"expected {value!r}, got {token}")
        self._at += 1
        return token

    def _expr(self):
        left = self._term()
        while self._peek() in (("op", "+"), ("op", "-")):
            left = _binary(left, self._take()[1], self._term())
        return left

    def _term(self):
        left = self._atom()
        while self._peek() in (("op", "*"), ("op", "/")):
            left = _binary(left, self._take()[1], self._atom())
        return left

    def _atom(self):
        kind, value = self._take()
        if kind == "num":
            return float(value)
        if (kind, value) == ("op", "("):
            inner = self._expr()
            self._take(")")
            return inner
        if kind != "name":
            raise ValueError(f"unexpected {value!r}")
        if value in ("sum", "avg", "max", "min"):
            return self._aggregate(value)
        if self._peek() == ("op", "("):
            return self._function(value)
        return self._selector(value)

    def _labels_list(self) -> list[str]:
        self._take("(")
        names = []
        while self._peek() != ("op", ")"):
            names.append(self._take()[1])
            if self._peek() == ("op", ","):
                self._take(",")
        self._take(")")
        return names

    def _aggregate(self, op: str):
        by = self._labels_list() if self._peek() == ("name", "by") and self._take() else None
        self._take("(")
        inner = self._expr()
        self._take(")")
        if by is None and self._peek() == ("name", "by"):
            self._take()
            by = self._labels_list()
        groups: dict[Labels, list[float]] = {}
        for labels, v in inner.items():
            key = Labels((k, x) for k, x in labels if k in (by or []))
            groups.setdefault(key, []).append(v)
        fold = {"sum": sum, "max": max, "min": min, "avg": lambda vs: sum(vs) / len(vs)}[op]
        return {key: fold(values) for key, values in groups.items()}

    def _function(self, name: str):
        self._take("(")
        args = [self._expr()]
        while self._peek() == ("op", ","):
            self._take(",")
            args.append(self._expr())
        self._take(")")
        if name in ("rate", "increase"):
            (series,) = args
            if not isinstance(series, RangeVector):
                raise ValueError(f"{name} needs a range selector")
            return series.delta(per_second=name == "rate")
        if name == "histogram_quantile":
            return _histogram_quantile(*args)
        if name == "clamp_min":
            vector, floor = args
            return {k: max(v, floor) for k, v in vector.items()}
        raise ValueError(f"function {name} is not supported")

    def _selector(self, name: str):
        matchers = {}
        if self._peek() == ("op", "{"):
            self._take("{")
            while self._peek() != ("op", "}"):
                label = self._take()[1]
                self._take("=")
                matchers[label] = self._take()[1].strip('"')
                if self._peek() == ("op", ","):
                    self._take(",")
            self._take("}")

        def pick(scrape: Scrape) -> Vector:
            return {labels: v for labels, v in scrape.samples.get(name, {}).items()
                    if all(dict(labels).get(k) == want for k, want in matchers.items())}

        if self._peek() is not None and self._peek()[0] == "range":
            self._take()
            return RangeVector(pick(self.before), pick(self.after), self.after.t - self.before.t)
        return pick(self.after)


class RangeVector(dict):
    def __init__(self, before: Vector, after: Vector, seconds: float) -> None:
        super().__init__(after)
        self.before, self.seconds = before, seconds

    def delta(self, per_second: bool) -> Vector:
        """Counter growth between the scrapes (series new in the window count from 0)."""
        out = {}
        for labels, value in self.items():
            grown = value - self.before.get(labels, 0.0)
            out[labels] = grown / self.seconds if per_second else grown
        return out


def _binary(left, op: str, right):
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
             "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))}[op]
    if isinstance(left, float) and isinstance(right, float):
        return apply(left, right)
    if isinstance(right, float):
        return {k: apply(v, right) for k, v in left.items()}
    if isinstance(left, float):
        return {k: apply(left, v) for k, v in right.items()}
    strip = lambda labels: Labels((k, v) for k, v in labels if k != "__name__")  # noqa: E731
    rights = {strip(k): v for k, v in right.items()}
    return {k: apply(v, rights[strip(k)]) for k, v in left.items() if strip(k) in rights}


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    series: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        le = dict(labels).get("le")
        if le is None:
            raise ValueError("histogram_quantile needs an le label")
        key = Labels((k, v) for k, v in labels if k != "le")
        series.setdefault(key, []).append((float(le), count))
    out = {}
    for key, points in series.items():
        points.sort()
        total = points[-1][1]
        if total <= 0:
            out[key] = math.nan
            continue
        rank, lower_bound, lower_count = q * total, 0.0, 0.0
        for bound, count in points:
            if count >= rank:
                if math.isinf(bound):
                    out[key] = lower_bound
                else:
                    width = count - lower_count
                    out[key] = lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 0)
                break
            lower_bound, lower_count = bound, count
    return out
