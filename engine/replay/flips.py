"""What a ``--flip`` means for one recorded run: dropped when it changes nothing, refused when the
model cannot honour it, and where a flipped replay stops each request (where the recording did)."""
from __future__ import annotations

from typing import Any

from engine.replay.record import RecordedRun, ReplayInputError, is_cut_short
from engine.spec.spec_support import speculation_rejection
from telemetry.levers import defaults

CUT_REASON = "replay: the recording stopped this request here"


def split_no_op_flips(recorded: RecordedRun, flips: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(flips that change something, one note per flip that does not).

    A flip to the value the run had from tick 0 and never changed replays the run as recorded;
    treating it as a flip would run past the recorded end and report a false difference.
    """
    start = {**defaults().as_dict(), **recorded.start_levers}
    changed = {c.name for c in recorded.lever_changes}
    kept, notes = {}, []
    for name, value in flips.items():
        if name not in changed and start.get(name) == value:
            notes.append(f"--flip {name}={value} changes nothing: the run had {name}={value} throughout, "
                         f"so this is a plain replay")
        else:
            kept[name] = value
    return kept, notes


def check_model_can_honour(flips: dict[str, Any], model: Any) -> None:
    """Refuse a flip the loaded model cannot run (today: a speculation kind it has no draft for)."""
    if "speculation" in flips:
        reason = speculation_rejection(flips["speculation"], model)
        if reason is not None:
            raise ReplayInputError(f"--flip speculation={flips['speculation']}: {reason}")


def recorded_cut_lengths(recorded: RecordedRun) -> dict[int, int]:
    """request id -> output tokens the recording holds, for requests the recording cut short."""
    tokens = recorded.output_tokens()
    return {r.request_id: len(tokens.get(r.request_id, [])) for r in recorded.requests
            if is_cut_short(r.status, r.error)}


def cut_where_recorded(sched, cut_lengths: dict[int, int]) -> None:
    """Cancel each request the recording cut short once it has as many tokens as the recording.

    Called between ticks of a flipped replay (which otherwise runs every request to its end).
    """
    # A request the recording cut before its first token may be prefilling here: a prefill's last
    # chunk samples a token, so it is cancelled before that (as the recording's was).
    prefilling = [sched.prefilling] if sched.prefilling is not None else []
    for request in list(sched.active) + prefilling:
        limit = cut_lengths.get(request.request_id)
        if limit is not None and request.num_generated >= limit:
            sched.cancel(request.request_id, CUT_REASON)
    # Cut before its first token (still queued or prefilling when the recording stopped): a
    # token 0 sampled here would already be one too many.
    for request in [*sched.waiting, *([sched.prefilling] if sched.prefilling is not None else [])]:
        if cut_lengths.get(request.request_id) == 0:
            sched.cancel(request.request_id, CUT_REASON)
