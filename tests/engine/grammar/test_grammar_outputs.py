"""Grammar-constrained sampling through the real engine on the tiny model: outputs that parse and validate."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine.workload.grammars import CHOICES, REGEXES
from telemetry import events as ev

from grammar_helpers import make_scheduler, prompt, run_to_end, text_of

SCHEMAS = [
    # objects with bounded strings and integer ranges
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    # arrays of integers in a range
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 6},
    # enums
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": ["S", "M", "L", "XL"]}},
     "required": ["color", "size"], "additionalProperties": False},
    # nested objects
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 100000},
            "item": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                                      "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                     "required": ["sku", "qty"], "additionalProperties": False}},
                  "required": ["id", "item"], "additionalProperties": False}},
     "required": ["order"], "additionalProperties": False},
    # arrays of objects, booleans, optional fields
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"k": {"type": "string", "maxLength": 4},
                                             "v": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k", "v"], "additionalProperties": False}},
        "note": {"type": "string", "maxLength": 6}},
     "required": ["ok", "items"], "additionalProperties": False},
    # bounded array of enums inside an object, with a string of fixed bounds
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 4},
                                      "code": {"type": "string", "minLength": 2, "maxLength": 3}},
     "required": ["tags", "code"], "additionalProperties": False},
]
NUM_SCHEMA_REQUESTS = 200


def submit_all(sched, grammars, *, temperature: float, max_tokens: int, seed: int):
    rng = random.Random(seed)
    return [sched.submit(i, prompt(rng), {"temperature": temperature, "max_tokens": max_tokens, "seed": seed * 1000 + i},
                         grammar=g) for i, g in enumerate(grammars)]


def test_200_sampled_schema_requests_parse_and_validate():
    rows: list = []
    sched = make_scheduler(rows=rows)
    grammars = [{"kind": "json_schema", "value": SCHEMAS[i % len(SCHEMAS)]} for i in range(NUM_SCHEMA_REQUESTS)]
    requests = submit_all(sched, grammars, temperature=1.0, max_tokens=192, seed=1)
    run_to_end(sched)
    stopped = [r for r in requests if r.finish_reason == "stop"]
    for request in stopped:
        value = json.loads(text_of(request))                     # parses
        jsonschema.validate(value, request.grammar_spec.value)   # and validates against its schema
        assert request.grammar_valid is True
    for request in requests:
        assert request.status == ev.REQ_FINISHED, request.error
        if request.finish_reason != "stop":
            assert request.finish_reason == "length" and request.grammar_valid is False
    assert len(stopped) / len(requests) >= 0.95, f"only {len(stopped)} of {len(requests)} ended with stop"
    ticks = [r for r in rows if isinstance(r, ev.Tick)]
    assert sum(t.num_constrained_rows for t in ticks) >= sum(len(r.output_tokens) for r in requests)
    assert all(t.grammar_mask_ns > 0 for t in ticks if t.num_constrained_rows)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_outputs_fullmatch(temperature):
    sched = make_scheduler()
    grammars = [{"kind": "regex", "value": r} for r in REGEXES] * 4 + \
               [{"kind": "choice", "value": list(c)} for c in CHOICES] * 4
    requests = submit_all(sched, grammars, temperature=temperature, max_tokens=96, seed=2)
    run_to_end(sched)
    for request in requests:
        assert request.finish_reason == "stop", (request.finish_reason, text_of(request))
        text = text_of(request)
        if request.grammar_spec.kind == "regex":
            assert re.fullmatch(request.grammar_spec.value, text), (request.grammar_spec.value, text)
        else:
            assert text in request.grammar_spec.value
        assert request.grammar_valid is True


def test_token_0_obeys_the_grammar_and_the_request_waits_for_its_compile():
    rows: list = []
    sched = make_scheduler(rows=rows)
    free = sched.submit(0, [5, 6, 7], {"max_tokens": 3})
    held = sched.submit(1, [5, 6, 7], {"max_tokens": 8}, grammar={"kind": "choice", "value": ["zq"]})
    run_to_end(sched)
    assert held.output_tokens == [ord("z"), ord("q")] and held.finish_reason == "stop"
    assert free.status == held.status == ev.REQ_FINISHED
    ready = [r for r in rows if isinstance(r, ev.RequestEvent) and r.kind == "grammar_ready"]
    admitted = [r for r in rows if isinstance(r, ev.RequestEvent) and r.kind == "admitted" and r.request_id == 1]
    assert ready and ready[0].request_id == 1 and ready[0].tick <= admitted[0].tick
    assert held.grammar_ready_tick == ready[0].tick


def test_a_pending_compile_does_not_hold_back_the_queue(monkeypatch):
    from concurrent.futures import Future
    sched = make_scheduler()
    gate: Future = Future()
    real_submit = sched.grammars.submit
    monkeypatch.setattr(sched.grammars, "submit", lambda spec: gate)
    held = sched.submit(0, [1, 2, 3], {"max_tokens": 4}, grammar={"kind": "regex", "value": "[ab]{2}"})
    free = sched.submit(1, [1, 2, 3], {"max_tokens": 4})
    for _ in range(12):
        sched.step()
    assert free.status == ev.REQ_FINISHED and held.status == ev.REQ_WAITING and held.admitted_tick is None
    gate.set_result(real_submit(held.grammar_spec).result(timeout=30))
    run_to_end(sched)
    assert held.finish_reason == "stop" and re.fullmatch("[ab]{2}", text_of(held))


def test_compile_errors_and_bad_specs_end_the_request_with_a_clear_error():
    sched = make_scheduler()
    bad_regex = sched.submit(0, [1, 2], {"max_tokens": 4}, grammar={"kind": "regex", "value": "[("})
    bad_kind = sched.submit(1, [1, 2], {"max_tokens": 4}, grammar={"kind": "yaml", "value": "x"})
    good = sched.submit(2, [1, 2], {"max_tokens": 4}, grammar={"kind": "choice", "value": ["ok"]})
    assert bad_kind.status == ev.REQ_REJECTED and "grammar.kind must be one of" in bad_kind.error
    run_to_end(sched)
    assert bad_regex.status == ev.REQ_REJECTED and bad_regex.error.startswith("grammar: regex grammar does not compile")
    assert "unclosed character class" in bad_regex.error
    assert good.finish_reason == "stop" and text_of(good) == "ok"
    assert sched.pools.blocks.num_used == 0


def test_no_tokenizer_means_grammars_are_refused():
    sched = make_scheduler(grammars=False)
    request = sched.submit(0, [1, 2], {"max_tokens": 4}, grammar={"kind": "json_object"})
    assert request.status == ev.REQ_REJECTED and "no grammar support" in request.error


def test_an_unsatisfiable_budget_ends_with_length_not_stop():
    sched = make_scheduler()
    request = sched.submit(0, [1, 2], {"max_tokens": 5}, grammar={"kind": "regex", "value": "a{10}"})
    run_to_end(sched)
    assert request.finish_reason == "length" and request.grammar_valid is False
    assert text_of(request) == "aaaaa"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_call_arguments_follow_the_tools_schema(temperature):
    from engine.grammar.tools import tool_call_spec
    from grammar_helpers import tiny
    model, _ = tiny()
    tools = [{"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "label": {"type": "string", "maxLength": 6}},
        "required": ["hour", "label"], "additionalProperties": False}}}]
    spec = tool_call_spec(tools, start_id=model.tool_call_start_id, end_id=model.tool_call_end_id)
    sched = make_scheduler()
    requests = submit_all(sched, [spec.to_dict()] * 6, temperature=temperature, max_tokens=96, seed=5)
    run_to_end(sched)
    for request in requests:
        out = request.output_tokens
        assert request.finish_reason == "stop" and out[0] == model.tool_call_start_id
        assert out[-1] == model.tool_call_end_id
        call = json.loads(text_of(request).removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call["name"] == "set_alarm"
        jsonschema.validate(call["arguments"], tools[0]["function"]["parameters"])
