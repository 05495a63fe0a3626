"""Adaptive sampling: greedy inside code fences and tool calls, the request's own sampling elsewhere.

Structured output (code, tool-call JSON) breaks on one unlucky low-probability
token, prose does not; with the ``adaptive_sampling`` lever on, rows whose
sequence is inside a code fence or a tool call are sampled greedily. Pure
functions over token ids, so the rule is tested without a model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from engine.scheduler.sampling import SamplingParams


@dataclass(frozen=True)
class StructureTokens:
    code_fence: int | None
    tool_call_start: int | None
    tool_call_end: int | None


@dataclass(frozen=True)
class Region:
    """Where a sequence stands after the tokens seen so far."""

    in_code_fence: bool = False
    in_tool_call: bool = False

    @property
    def is_structured(self) -> bool:
        return self.in_code_fence or self.in_tool_call


def advance(region: Region, token: int, ids: StructureTokens) -> Region:
    """The region after one more token: a fence toggles, tool-call start/end open and close."""
    if ids.code_fence is not None and token == ids.code_fence:
        return dataclasses.replace(region, in_code_fence=not region.in_code_fence)
    if ids.tool_call_start is not None and token == ids.tool_call_start:
        return dataclasses.replace(region, in_tool_call=True)
    if ids.tool_call_end is not None and token == ids.tool_call_end:
        return dataclasses.replace(region, in_tool_call=False)
    return region


def region_of(tokens: Iterable[int], ids: StructureTokens) -> Region:
    region = Region()
    for token in tokens:
        region = advance(region, token, ids)
    return region


def params_for_row(params: SamplingParams, region: Region, is_adaptive: bool) -> SamplingParams:
    """The request's params, or their greedy version inside structured output when the lever is on."""
    if is_adaptive and region.is_structured and not params.is_greedy:
        return dataclasses.replace(params, temperature=0.0)
    return params
