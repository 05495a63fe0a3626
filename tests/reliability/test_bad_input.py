"""Bad requests are rejected at admission with a message naming the field, before any forward.

Through the scheduler (``Scheduler.submit``) and through ``python -m engine generate``
(exit 2, one line on stderr, no traceback).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from reliability_helpers import REPO, child_env

from engine.__main__ import main as engine_main
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults

FORWARDS = ("forward",)
CONTEXT = 32768           # the tiny model's max_position_embeddings
NAN = float("nan")

# (what, prompt, sampling, words the error must contain)
SCHEDULER_CASES = [
    ("longer than the context", [1] * CONTEXT, {}, ["prompt_tokens", "context of 32768"]),
    ("longer than the whole KV cache", [1] * 100, {}, ["prompt_tokens", "KV blocks", "whole cache"]),
    ("prompt + max_tokens over the KV cache", [1] * 60, {"max_tokens": 8}, ["max_tokens", "whole cache"]),
    ("empty prompt", [], {}, ["prompt_tokens", "empty"]),
    ("token id past the vocabulary", [1, 272], {}, ["prompt_tokens[1]", "vocabulary"]),
    ("negative token id", [-1, 2], {}, ["prompt_tokens[0]", "vocabulary"]),
    ("non-integer token", [1, "x"], {}, ["prompt_tokens[1]", "not an integer"]),
    ("NaN token", [1, NAN], {}, ["prompt_tokens[1]", "not an integer"]),
    ("negative temperature", [1, 2], {"temperature": -0.5}, ["temperature"]),
    ("NaN temperature", [1, 2], {"temperature": NAN}, ["temperature"]),
    ("top_p zero", [1, 2], {"temperature": 1.0, "top_p": 0.0}, ["top_p", "(0, 1]"]),
    ("top_p above one", [1, 2], {"temperature": 1.0, "top_p": 1.5}, ["top_p", "(0, 1]"]),
    ("top_p NaN", [1, 2], {"temperature": 1.0, "top_p": NAN}, ["top_p"]),
    ("top_k negative", [1, 2], {"top_k": -1}, ["top_k"]),
    ("min_p above one", [1, 2], {"min_p": 2.0}, ["min_p"]),
    ("max_tokens zero", [1, 2], {"max_tokens": 0}, ["max_tokens"]),
    ("stop token out of range", [1, 2], {"stop_token_ids": [9999]}, ["stop_token_ids"]),
    ("unknown sampling field", [1, 2], {"temprature": 0.7}, ["unknown field", "temprature"]),
]


@pytest.fixture
def counted_runner(tiny_model):
    """A real runner (4 KV blocks = 64 tokens) whose forwards are counted."""
    runner = ModelRunner.build(tiny_model, num_kv_blocks=4, num_ssm_slots=2)
    calls = {name: 0 for name in FORWARDS}
    for name in FORWARDS:
        real = getattr(runner, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        setattr(runner, name, counted)
    return runner, calls


def test_scheduler_rejects_each_bad_request_naming_the_field_without_a_forward(counted_runner):
    runner, calls = counted_runner
    rows: list = []
    sched = Scheduler(runner, defaults(), emit=rows.append)
    for index, (what, prompt, sampling, words) in enumerate(SCHEDULER_CASES):
        request = sched.submit(index, prompt, sampling)
        assert request.status == ev.REQ_REJECTED, what
        for word in words:
            assert word in request.error, f"{what}: {request.error!r} should name {word!r}"
        assert "\n" not in request.error and len(request.error) < 300, what
    assert not sched.has_work and sched.step() is False
    assert calls == {name: 0 for name in FORWARDS}, "a rejected request reached a forward"
    rejected = [r for r in rows if isinstance(r, ev.RequestEvent) and r.kind == "rejected"]
    assert [r.request_id for r in rejected] == list(range(len(SCHEDULER_CASES)))
    assert runner.pools.blocks.num_used == 0 and runner.pools.ssm.num_used == 0

    # The loop is unharmed: a good request right after all of them runs to its tokens.
    good = sched.submit(100, [5, 6, 7], {"max_tokens": 3})
    while sched.has_work:
        sched.step()
    assert good.status == ev.REQ_FINISHED and len(good.output_tokens) == 3
    assert calls["forward"] >= 1


GENERATE_CASES = [
    ("empty prompt", ["--prompt-ids", ""], ["prompt is empty"]),
    ("token id past the vocabulary", ["--prompt-ids", "1,272"], ["--prompt-ids", "vocabulary"]),
    ("negative token id", ["--prompt-ids", "1,-3"], ["--prompt-ids", "vocabulary"]),
    ("non-integer token", ["--prompt-ids", "1,x"], ["--prompt-ids", "integers"]),
    ("longer than the context", ["--prompt-ids", ",".join(["1"] * CONTEXT)], ["--prompt-ids", "context"]),
    ("negative temperature", ["--prompt-ids", "1,2", "--temperature", "-1"], ["temperature"]),
    ("NaN temperature", ["--prompt-ids", "1,2", "--temperature", "nan"], ["temperature"]),
    ("top-p zero", ["--prompt-ids", "1,2", "--temperature", "1", "--top-p", "0"], ["top_p"]),
    ("top-p above one", ["--prompt-ids", "1,2", "--temperature", "1", "--top-p", "1.5"], ["top_p"]),
    ("top-k negative", ["--prompt-ids", "1,2", "--top-k", "-1"], ["top_k"]),
    ("max-tokens zero", ["--prompt-ids", "1,2", "--max-tokens", "0"], ["max_tokens"]),
    ("max-tokens not a number", ["--prompt-ids", "1,2", "--max-tokens", "many"], ["--max-tokens"]),
]


@pytest.mark.parametrize("what,argv,words", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_cli_rejects_bad_input_with_one_line(what, argv, words, capsys, monkeypatch):
    def no_forward(*_args, **_kwargs):
        raise AssertionError(f"{what}: reached a forward")
    for name in FORWARDS:
        monkeypatch.setattr(ModelRunner, name, no_forward)
    try:
        code = engine_main(["generate", "--model", "tiny", "--json", *argv])
    except SystemExit as exc:          # argparse type errors exit from the parser
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, what
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{what}: expected one line, got {err!r}"
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], f"{what}: {lines[0]!r} should name {word!r}"


def test_generate_process_exits_2_with_one_line_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", "tiny", "--prompt-ids", "1,2,3",
                           "--temperature", "nan", "--json"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr
