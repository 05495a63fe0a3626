"""Where requests are (``Queues``) and how they end inside the loop (``endings``): finish, preempt and
the victim choice, on real requests and a recording context, no model."""
from __future__ import annotations

from types import SimpleNamespace

from engine.cache.kv import BlockManager
from engine.grammar.masks import MaskStats
from engine.scheduler.context import TickContext
from engine.scheduler.endings import PREEMPT_FOR_DECODE, PREEMPT_FOR_PREFILL, choose_victim, finish, preempt
from engine.scheduler.queues import Queues
from engine.scheduler.request import Request
from engine.scheduler.sampling import SamplingParams
from telemetry import events as ev
from telemetry.levers import defaults


def request(request_id: int, *, blocks: int = 0, grammar: bool = False, admitted: int = 0) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), arrival_ns=0, arrival_tick=0)
    r.seq.block_table = list(range(100 * request_id, 100 * request_id + blocks))
    r.has_grammar, r.admitted_tick = grammar, admitted
    return r


class Pools:
    def __init__(self) -> None:
        self.released: list[int] = []
        self.blocks = BlockManager(64, 16)

    def release(self, seq) -> None:
        self.released.append(seq.request_id)
        seq.block_table = []


def context(rows: list, policy: str = "most_blocks") -> TickContext:
    return TickContext(5, defaults().replace(preempt_policy=policy), None, None, rows.append, lambda: 42, None,
                       ev.PATH_DECODE, MaskStats())


def test_retire_moves_ended_requests_out_in_order_and_counts_them():
    queues = Queues()
    a, b, c, p = request(1), request(2), request(3), request(4)
    queues.active, queues.prefilling = [a, b, c], p
    b.finished_ns = c.finished_ns = p.finished_ns = 1
    assert queues.retire() == 3
    assert queues.active == [a] and queues.prefilling is None
    assert [r.request_id for r in queues.done] == [2, 3, 4] and queues.num_done == 3
    queues.keep_recent_done(2)
    queues.mark_done([a])
    assert [r.request_id for r in queues.done] == [4, 1] and queues.num_done == 4
    assert not Queues().has_work and queues.has_work


def test_start_decoding_moves_the_newborn_into_the_batch():
    queues = Queues()
    newborn = request(7)
    queues.prefilling = newborn
    queues.start_decoding(newborn)
    assert queues.prefilling is None and queues.active == [newborn]


def test_finish_frees_the_caches_sets_the_status_and_logs_the_row():
    rows: list = []
    pools = Pools()
    done, failed, cut = request(1), request(2), request(3)
    done.pending_drafts, done.pending_drafts_at = [5, 6], 3
    finish(context(rows), pools, done, "eos")
    finish(context(rows), pools, failed, "error", "boom")
    finish(context(rows), pools, cut, ev.REQ_CANCELLED, "cancelled: bye", status=ev.REQ_CANCELLED)
    assert pools.released == [1, 2, 3]
    assert (done.status, done.finish_reason, done.error, done.finished_ns) == (ev.REQ_FINISHED, "eos", None, 42)
    assert (failed.status, failed.error) == (ev.REQ_ERROR, "boom") and cut.status == ev.REQ_CANCELLED
    assert done.pending_drafts == [] and done.pending_drafts_at is None and done.grammar_valid is None
    kinds = [(r.request_id, r.kind) for r in rows if isinstance(r, ev.RequestEvent)]
    assert kinds == [(1, "finished"), (2, ev.REQ_ERROR), (3, ev.REQ_CANCELLED)]
    assert all(r.tick == 5 for r in rows) and sum(isinstance(r, ev.RequestRecord) for r in rows) == 3


def test_the_victim_is_the_policys_pick_and_never_a_grammar_holder_unless_asked():
    holder, big, small = request(1, blocks=9, grammar=True), request(2, blocks=5, admitted=1), request(3, blocks=2,
                                                                                                       admitted=2)
    assert choose_victim([holder, big, small], "most_blocks") is big
    assert choose_victim([holder, big, small], "newest") is small
    assert choose_victim([holder], "most_blocks") is None
    assert choose_victim([holder, big], "most_blocks", grammar_exempt=False) is holder


def test_preempt_ends_the_victim_and_writes_its_row():
    rows: list = []
    queues, pools = Queues(), Pools()
    holder, victim, other = request(1, grammar=True), request(2, blocks=3), request(3)
    queues.active = [holder, victim, other]
    preempt(context(rows), queues, pools, victim, prefill_request=request(9))
    preempt(context(rows), queues, pools, other, prefill_request=None)
    assert queues.active == [holder] and [r.request_id for r in queues.done] == [2, 3] and queues.num_preemptions == 2
    assert victim.status == ev.REQ_PREEMPTED and victim.error == PREEMPT_FOR_PREFILL and other.error == PREEMPT_FOR_DECODE
    first, second = [r for r in rows if isinstance(r, ev.Preemption)]
    assert (first.victim_request_id, first.prefill_request_id, first.num_remaining, first.num_grammar_skipped,
            first.policy) == (2, 9, 2, 1, "most_blocks")
    assert second.prefill_request_id is None and second.num_remaining == 1


def test_a_context_builds_no_event_without_a_sink():
    quiet = TickContext(0, defaults(), None, None, None, lambda: 0, None, ev.PATH_IDLE, MaskStats())
    quiet.event("anything", 1, {"x": 1})
    quiet.emit_request(SimpleNamespace(request_id=1), "arrived")   # no record is even built
    rows: list = []
    context(rows).event("drafts_dropped", None, None)
    assert rows[0].kind == "drafts_dropped" and rows[0].detail == {} and rows[0].tick == 5
