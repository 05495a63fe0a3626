"""n > 1: the choices of one API request are sibling requests sharing one prompt.

The API submits n requests with the same prompt tokens (``features.n`` / ``features.choice``),
in one message, so they get consecutive request ids and queue one behind the other. Only one
request prefills at a time, so by the time sibling 1 is admitted sibling 0's prompt blocks
are in the prefix cache; what a hybrid model's hit also needs is an SSM snapshot at a block
boundary. Sibling 0 therefore keeps one at its prompt's tail boundary (the last full block
before its last token) even with the ``ssm_tail_ckpt`` lever off, and its siblings prefill
only the prompt's last partial block. Pure decisions; the planner and the prefix step ask.
"""
from __future__ import annotations

from engine.scheduler.request_features import RequestFeatures
from telemetry.levers import LeverValues


def keeps_tail_snapshot(features: RequestFeatures, *, prefix_on: bool) -> bool:
    """Should this request's prefill stop at, and snapshot, its tail boundary for siblings to come?"""
    return prefix_on and features.n > 1 and features.choice == 0 \
        and features.prompt_logprobs is None   # siblings asking for prompt logprobs take no hit anyway


def tail_ckpt(levers: LeverValues, features: RequestFeatures, *, prefix_on: bool) -> bool:
    """The ``ssm_tail_ckpt`` rule for this request: the lever, or a sibling group's first member."""
    return levers.ssm_tail_ckpt or keeps_tail_snapshot(features, prefix_on=prefix_on)


def group_key(request_id: int, n: int, choice: int) -> int:
    """The request id of a sibling group's first member (siblings arrive with consecutive ids)."""
    return request_id - choice if n > 1 else request_id
