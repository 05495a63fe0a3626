"""Structural validator for Chrome trace JSON (what Perfetto needs to draw it right).

Returns a list of problems (empty = valid), so tests can also prove that each
rule catches a broken trace.
"""
from __future__ import annotations

import collections
import numbers
from typing import Any

KNOWN_PHASES = {"M", "X", "b", "e", "C", "i"}


def _ns(us: float) -> int:
    return round(us * 1000)


def validate_trace(trace: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    named_tids, named_pids, used_tids = set(), set(), set()
    slices = collections.defaultdict(list)
    flows_out, flows_in = collections.Counter(), collections.Counter()
    async_open: dict[tuple, list[str]] = collections.defaultdict(list)
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph not in KNOWN_PHASES:
            problems.append(f"event {i}: unexpected phase {ph!r}")
            continue
        if ph == "M":
            if e.get("name") == "thread_name" and e.get("args", {}).get("name"):
                named_tids.add((e["pid"], e["tid"]))
            if e.get("name") == "process_name" and e.get("args", {}).get("name"):
                named_pids.add(e["pid"])
            continue
        if not isinstance(e.get("ts"), numbers.Real) or e["ts"] < 0:
            problems.append(f"event {i}: ts {e.get('ts')!r} is not a number >= 0")
            continue
        if ph == "X":
            if not isinstance(e.get("dur"), numbers.Real) or e["dur"] < 0:
                problems.append(f"event {i}: X slice dur {e.get('dur')!r} invalid")
                continue
            used_tids.add((e["pid"], e["tid"]))
            slices[(e["pid"], e["tid"])].append((_ns(e["ts"]), _ns(e["ts"] + e["dur"]), i))
            if "bind_id" in e:
                if e.get("flow_out"):
                    flows_out[e["bind_id"]] += 1
                if e.get("flow_in"):
                    flows_in[e["bind_id"]] += 1
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args:
                problems.append(f"event {i}: counter {e.get('name')!r} has no args")
            elif not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in args.values()):
                problems.append(f"event {i}: counter {e.get('name')!r} has a non-numeric value {args}")
        elif ph in ("b", "e"):
            key = (e.get("pid"), e.get("cat"), e.get("id"))
            if e.get("id") is None:
                problems.append(f"event {i}: async {ph} without an id")
            elif ph == "b":
                async_open[key].append(e.get("name"))
            elif not async_open[key] or async_open[key][-1] != e.get("name"):
                problems.append(f"event {i}: async end {e.get('name')!r} for {key} does not close the innermost "
                                f"open slice {async_open[key][-1:]}")
            else:
                async_open[key].pop()
        elif ph == "i":
            used_tids.add((e["pid"], e["tid"]))
    for key, names in async_open.items():
        if names:
            problems.append(f"async slices {names} of {key} never end")
    for track in sorted(used_tids - named_tids):
        problems.append(f"track pid={track[0]} tid={track[1]} has no thread_name")
    for pid in {t[0] for t in used_tids} - named_pids:
        problems.append(f"process {pid} has no process_name")
    for track, items in slices.items():
        problems += _nesting_problems(track, items)
    for bind_id in set(flows_out) | set(flows_in):
        if flows_out[bind_id] != 1 or flows_in[bind_id] != 1:
            problems.append(f"flow {bind_id!r}: {flows_out[bind_id]} start(s), {flows_in[bind_id]} end(s)")
    return problems


def _nesting_problems(track: tuple, items: list[tuple[int, int, int]]) -> list[str]:
    """Slices on one track must form a tree: each one ends inside whatever encloses its start."""
    problems, stack = [], []
    for start, end, i in sorted(items, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][1] <= start:  # ended before (or as) this one starts
            stack.pop()
        if stack and end > stack[-1][1]:
            problems.append(f"track {track}: slice {i} [{start}, {end}] ns partially overlaps slice "
                            f"{stack[-1][2]} [{stack[-1][0]}, {stack[-1][1]}] ns")
        stack.append((start, end, i))
    return problems
