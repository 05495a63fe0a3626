"""n > 1: the choices of one API request are sibling requests sharing one prompt.

The API submits n requests with the same prompt tokens (``features.n`` / ``features.choice``),
in one message, so they get consecutive request ids and queue one behind the other. Only one
request prefills at a time, so by the time sibling 1 is admitted sibling 0's prompt blocks
are in the prefix cache; what a hybrid model's hit also needs is an SSM snapshot at a block
boundary. Sibling 0 therefore keeps one at its prompt's tail boundary (the last full block
before its last token) even with the ``ssm_tail_ckpt`` lever off, and its siblings prefill
only the prompt's last partial block. Pure decisions; the prefill step and the prefix step ask.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduler.loop import Scheduler
    from engine.scheduler.request import Request


def keeps_tail_snapshot(sched: Scheduler, req: Request) -> bool:
    """Should this request's prefill stop at, and snapshot, its tail boundary for siblings to come?"""
    features = req.features
    return sched.prefix is not None and features.n > 1 and features.choice == 0 \
        and features.prompt_logprobs is None   # siblings asking for prompt logprobs take no hit anyway


def tail_ckpt(sched: Scheduler, req: Request) -> bool:
    """The ``ssm_tail_ckpt`` rule for this request: the lever, or a sibling group's first member."""
    return sched.levers.ssm_tail_ckpt or keeps_tail_snapshot(sched, req)


def group_key(request_id: int, n: int, choice: int) -> int:
    """The request id of a sibling group's first member (siblings arrive with consecutive ids)."""
    return request_id - choice if n > 1 else request_id
