"""Speculation on the Kimi Linear family: n-gram and self drafts emit exactly the tokens of speculation off.

The verify forward runs the drafts as a chunk over the latent cache (MLA) and keeps every row's
KDA state (a partial acceptance re-feeds nothing); tiny-kimi has no MTP module, so ``mtp`` is
refused with the reason logged.
"""
from __future__ import annotations

import random

import pytest

from engine.model.loader import load_model
from tests.engine.spec.test_spec_identity import SAMPLED, serve, spec_details
from telemetry import events as ev
from telemetry.levers import defaults

GREEDY = {"max_tokens": 40}


@pytest.fixture(scope="module")
def kimi():
    return load_model("tiny-kimi")[0]


def arrivals():
    rng = random.Random(4)
    unit = [rng.randrange(256) for _ in range(6)]
    prompts = [(unit * 9)[:50], [rng.randrange(256) for _ in range(30)], (unit[:3] * 12)[:33]]
    return {0: [(0, prompts[0], GREEDY)], 1: [(1, prompts[1], SAMPLED)], 60: [(2, prompts[2], GREEDY)]}


@pytest.mark.parametrize("kind", ["ngram", "self"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole_prompt", "mla_chunked_prefill"])
def test_drafts_change_no_token(kimi, kind, chunked):
    levers = defaults().replace(mla_chunked_prefill=chunked, max_prefill_tokens=32)
    off, _ = serve(kimi, arrivals(), levers)
    on, rows = serve(kimi, arrivals(), levers.replace(speculation=kind, num_speculative_tokens=2))
    assert on == off and all(status == ev.REQ_FINISHED for status, _ in off.values())
    # The drafts were really verified. tiny-kimi's random weights accept none of them (its continuations
    # repeat nothing and its early exit agrees with no full step), so each verify rolls back: the KDA
    # state to the row before the first draft, the latents rewritten; the per-row states a partial
    # acceptance keeps are checked at the layer (tests/engine/model/test_kda.py).
    details = spec_details(rows)
    assert sum(d["num_drafted"] for d in details) > 0 and any(d["rolled_back"] for d in details)


def test_mtp_is_refused_with_the_reason(kimi):
    _, rows = serve(kimi, {0: [(0, [1, 2, 3, 4], GREEDY)]}, defaults().replace(speculation="mtp"))
    refused = [r for r in rows if isinstance(r, ev.LeverChange) and r.status == "rejected"]
    assert refused and "MTP" in refused[0].reason.upper()
