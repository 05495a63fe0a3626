"""Grammars through ``python -m engine generate`` and the synthetic workload's ``grammar_share``."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.__main__ import main
from engine.grammar.spec import GrammarSpec
from engine.workload.bundle import read_workload_jsonl, write_workload_jsonl
from engine.workload.grammars import GRAMMAR_MAX_TOKENS, builtin_grammars
from engine.workload.request import WorkloadError
from engine.workload.synthetic import SyntheticWorkload

from grammar_helpers import make_scheduler

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "tag": {"enum": ["x", "y"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def generate(capsys, *args):
    code = main(["generate", "--model", "tiny", "--prompt", "Hello", "--json", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.0", "--seed", "4"]])
def test_generate_json_schema(capsys, tmp_path, sampling):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    code, result, err = generate(capsys, "--json-schema", str(path), "--max-tokens", "64", *sampling)
    assert code == 0, err
    assert result["finish_reason"] == "stop" and result["grammar_complete"] is True
    jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_generate_regex_and_choice(capsys):
    code, result, err = generate(capsys, "--regex", "[a-c]{2}-[0-9]{3}", "--temperature", "1", "--seed", "1")
    assert code == 0, err
    assert re.fullmatch("[a-c]{2}-[0-9]{3}", result["text"]) and result["finish_reason"] == "stop"
    code, result, err = generate(capsys, "--choice", "alpha,beta", "--temperature", "1", "--seed", "2")
    assert code == 0 and result["text"] in ("alpha", "beta")


def test_generate_length_when_the_budget_is_short(capsys):
    code, result, _ = generate(capsys, "--regex", "[a-z]{30}", "--max-tokens", "5")
    assert result["finish_reason"] == "length" and result["grammar_complete"] is False
    assert re.fullmatch("[a-z]{5}", result["text"])


@pytest.mark.parametrize("args, message", [
    (["--regex", "[("], "regex grammar does not compile"),
    (["--regex", "a", "--choice", "b"], "at most one of"),
    (["--json-schema", "/no/such/schema.json"], "No such file"),
])
def test_generate_bad_grammars_exit_2_with_one_line(capsys, args, message):
    code, _, err = generate(capsys, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_synthetic_grammar_share_draws_builtin_grammars():
    plain = SyntheticWorkload(num_requests=80, vocab_size=272, seed=3).requests()
    mixed = SyntheticWorkload(num_requests=80, vocab_size=272, seed=3, grammar_share=0.5).requests()
    with_grammar = [s for s in mixed if s.grammar is not None]
    assert 25 <= len(with_grammar) <= 55
    assert {json.dumps(s.grammar, sort_keys=True) for s in with_grammar} <= \
        {json.dumps(g, sort_keys=True) for g in builtin_grammars()}
    assert all(s.sampling["max_tokens"] == GRAMMAR_MAX_TOKENS and s.sampling["min_tokens"] == 0 for s in with_grammar)
    # The grammar draws have their own stream: arrivals and prompts are those of the plain workload.
    assert [(s.arrival_s, s.prompt_tokens) for s in mixed] == [(s.arrival_s, s.prompt_tokens) for s in plain]
    assert all(s.grammar is None for s in plain)
    with pytest.raises(WorkloadError, match="grammar_share"):
        SyntheticWorkload(num_requests=1, vocab_size=272, grammar_share=1.5)


def test_workload_jsonl_round_trips_the_grammar(tmp_path):
    specs = SyntheticWorkload(num_requests=20, vocab_size=272, seed=1, grammar_share=0.6).requests()
    write_workload_jsonl(specs, tmp_path / "w.jsonl")
    back = read_workload_jsonl(tmp_path / "w.jsonl")
    assert [s.grammar for s in back] == [s.grammar for s in specs]
    (tmp_path / "bad.jsonl").write_text(json.dumps({**specs[0].to_json(), "grammar": "regex"}) + "\n")
    with pytest.raises(WorkloadError, match="grammar must be a JSON object"):
        read_workload_jsonl(tmp_path / "bad.jsonl")


def test_every_builtin_grammar_compiles():
    sched = make_scheduler()
    for grammar in builtin_grammars():
        sched.grammars.compile_now(GrammarSpec.parse(grammar), timeout_s=60)
