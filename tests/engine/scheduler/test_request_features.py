"""Request features in the scheduler: stop strings end the output, first-token rules come from the
request and are recorded, bad features are rejected naming the field."""
from __future__ import annotations

import pytest

from engine.serve.engine_setup import build_engine
from engine.scheduler.request_features import RequestFeatures, find_stop_string
from telemetry import events as ev
from telemetry.levers import defaults

PROMPT = list(b"Once upon a time")


@pytest.fixture(scope="module")
def setup():
    return build_engine("tiny", kv_blocks=64, ssm_slots=4, levers=defaults())


def run(setup, request_id, features, **sampling):
    sched = setup.scheduler
    request = sched.submit(request_id, PROMPT, {"max_tokens": 24, "temperature": 0.0, **sampling}, features=features)
    while sched.has_work:
        sched.step()
    return request


def test_stop_string_ends_the_output_at_its_first_completion(setup):
    base = run(setup, 0, None, min_tokens=24)
    text = setup.tokenizer.decode(base.output_tokens)
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stopped = run(setup, 1, RequestFeatures(stop_strings=(stop,)))
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop
    assert stopped.output_tokens == base.output_tokens[:len(stopped.output_tokens)]
    out = setup.tokenizer.decode(stopped.output_tokens)
    assert find_stop_string(out, (stop,)) is not None
    assert find_stop_string(setup.tokenizer.decode(stopped.output_tokens[:-1]), (stop,)) is None


def test_first_token_rules_come_from_the_request(setup):
    model = setup.model
    forced = run(setup, 2, RequestFeatures(require_tool_call=True))
    assert forced.output_tokens[0] == model.tool_call_start_id and forced.first_token_rules == "force_tool_call"
    thinking = run(setup, 3, {"enable_thinking": True, "require_tool_call": True}, min_tokens=1)
    assert thinking.first_token_rules == "min_tokens,thinking"
    assert thinking.output_tokens[0] not in (model.think_end_id, model.tool_call_start_id)
    assert run(setup, 4, None).first_token_rules is None
    record = thinking.record(0, 0)
    assert record.features["enable_thinking"] and record.source == "workload"


@pytest.mark.parametrize("features, field", [
    ({"logprobs": 99}, "features.logprobs"), ({"stop_strings": [""]}, "features.stop_strings"),
    ({"source": "mars"}, "features.source"), ({"thinking": True}, "unknown field")])
def test_bad_features_are_rejected(setup, features, field):
    request = setup.scheduler.submit(10, PROMPT, {"max_tokens": 4}, features=features)
    assert request.status == ev.REQ_REJECTED and field in request.error
