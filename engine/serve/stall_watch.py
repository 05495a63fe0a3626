"""The serve loop's view of a stall: no step possible, work waiting. Reported once per blocker.

A step that returns False with requests waiting means the head request cannot
start and nothing else runs (see ``engine.scheduler.stall``). Re-stepping at
once would spin a core for as long as the stall lasts, so the loop waits on the
levers file (the only thing that can raise a cap) with a timeout, and this
watcher logs the blocker, emits a ``stalled`` event and hands the text to the
heartbeat file, once per new blocker; ``stall_cleared`` when work moves again.
"""
from __future__ import annotations

import logging

from engine.scheduler.chunk_plan import whole_prompt_rule
from engine.scheduler.stall import blocker, head_needs
from telemetry import events as ev

log = logging.getLogger("chunkscope.serve")

STALL_WAIT_S = 0.25   # longest wait before looking again (arrivals, the stat check, a stop signal)


class StallWatch:
    def __init__(self) -> None:
        self.blocker: str | None = None     # set while no progress is possible
        self.num_stalls = 0

    def head_blocker(self, sched) -> str | None:
        """What keeps the head of the queue waiting now (also while others run), or None."""
        if sched.prefilling is not None:
            return None
        needs = head_needs(sched.waiting, sched.pools, sched.levers.max_prefill_tokens,
                           whole_prompt_rule(sched.runner.is_mla, sched.levers.mla_chunked_prefill))
        return blocker(needs) if needs is not None else None

    def after_step(self, sched, progressed: bool) -> bool:
        """Note one step's outcome; True when the loop should wait (nothing could run)."""
        stalled = not progressed and sched.has_work
        text = (self.head_blocker(sched) or "no request can start") if stalled else None
        if text != self.blocker:
            self._report(sched, text)
        return stalled

    def _report(self, sched, text: str | None) -> None:
        head = sched.waiting[0].request_id if sched.waiting else None
        if text is not None:
            self.num_stalls += 1
            log.warning("no progress possible at tick %d (%d waiting): %s", sched.tick, len(sched.waiting), text)
            sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=ev.EVENT_STALLED, request_id=head,
                                       detail={"blocker": text, "num_waiting": len(sched.waiting)}))
        else:
            log.info("progress again at tick %d (was: %s)", sched.tick, self.blocker)
            sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=ev.EVENT_STALL_CLEARED,
                                       request_id=head, detail={"blocker": self.blocker}))
        self.blocker = text

    def status_fields(self, sched) -> dict:
        """The heartbeat's picture of the caches and the queue head."""
        bm, pool = sched.pools.blocks, sched.pools.ssm
        return {"is_blocked": self.blocker is not None,
                "blocker": self.blocker or self.head_blocker(sched),
                "head_request_id": sched.waiting[0].request_id if sched.waiting else None,
                "kv_blocks_used": bm.num_used, "kv_blocks_usable": bm.num_usable, "kv_blocks_cap": bm.cap,
                "ssm_slots_used": pool.num_used, "ssm_slots_total": pool.num_slots}
