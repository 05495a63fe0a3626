"""``python -m engine generate`` refusing what the model cannot run, before any forward: the model's context,
a missing tokenizer, a grammar with speculation; and replay's ``--flip`` parsing. One line, exit 2."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.__main__ import main
from engine.cli.generate import check_request
from engine.cli.replay import parse_flips
from engine.model.embedded import checkpoint_dir_of
from engine.model.loader import load_model
from engine.scheduler.sampling import SamplingParams
from telemetry.levers import LeversError


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_refusal(code: int, out: str, err: str, words: str) -> None:
    assert code == 2, err
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert words in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny():
    model, config, tokenizer = load_model("tiny")
    return model, tokenizer


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """The tiny checkpoint without its tokenizer.json."""
    directory = tmp_path_factory.mktemp("tiny-no-tokenizer")
    for file in checkpoint_dir_of("tiny").iterdir():
        if file.is_file() and file.name != "tokenizer.json":
            shutil.copy(file, directory / file.name)
    return directory


def test_check_request_counts_prompt_and_output_and_refuses_the_context(tiny):
    model, _ = tiny
    context = model.config.max_position_embeddings
    assert check_request(model, [1, 2, 3], SamplingParams(max_tokens=5)) == 8
    assert check_request(model, [1] * (context - 1), SamplingParams(max_tokens=1)) == context
    with pytest.raises(ValueError, match=f"{context} tokens do not fit the model's context of {context}"):
        check_request(model, [1] * context, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=f"--max-tokens {context}: with the 2-token prompt that is {context + 2}"):
        check_request(model, [1, 2], SamplingParams(max_tokens=context))
    with pytest.raises(ValueError, match=r"token id\(s\) \[-1\] outside the vocabulary"):
        check_request(model, [-1, 3], SamplingParams(max_tokens=1))


def test_a_request_over_the_context_exits_2_before_a_cache_is_sized(capsys, tiny):
    context = tiny[0].config.max_position_embeddings
    # A runner for this many tokens would be ~context/16 KV blocks: the refusal comes first.
    code, out, err = run_cli(capsys, "--prompt-ids", "1,2", "--max-tokens", str(context))
    assert_one_line_refusal(code, out, err, "more than the model's context")


def test_text_output_is_the_decoded_text_of_the_json_tokens(capsys, tiny):
    _, tokenizer = tiny
    args = ["--prompt", "abc", "--max-tokens", "6", "--ignore-eos"]
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["finish_reason"] == "length" and len(result["tokens"]) == 6
    code, text, err = run_cli(capsys, *args)
    assert code == 0, err
    assert text == result["text"] + "\n"
    assert result["text"] == tokenizer.decode([t for t in result["tokens"] if t != tiny[0].eos_token_id])


def test_a_checkpoint_without_a_tokenizer_prints_token_ids_and_refuses_text(capsys, no_tokenizer):
    code, out, err = run_cli(capsys, "--model", str(no_tokenizer), "--prompt-ids", "5,6", "--max-tokens", "3",
                             "--ignore-eos")
    assert code == 0, err
    assert len(out.split()) == 3 and all(part.isdigit() for part in out.split())
    assert_one_line_refusal(*run_cli(capsys, "--model", str(no_tokenizer), "--prompt", "hi"),
                            "has no tokenizer.json; use --prompt-ids")
    assert_one_line_refusal(*run_cli(capsys, "--model", str(no_tokenizer), "--prompt-ids", "5", "--regex", "a+"),
                            "a grammar needs the model's tokenizer.json")


@pytest.mark.parametrize("args, words", [
    (["--speculation", "ngram", "--choice", "yes,no"], "give no --json-schema, --regex or --choice with it"),
    (["--regex", "a", "--choice", "b"], "give at most one of --json-schema, --regex and --choice"),
    (["--regex", "("], "regex"),
])
def test_grammar_options_that_cannot_run_exit_2(capsys, args, words):
    assert_one_line_refusal(*run_cli(capsys, "--prompt-ids", "5,6", *args), words)


def test_a_missing_schema_file_names_the_file(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    code, out, err = run_cli(capsys, "--prompt-ids", "5", "--json-schema", str(missing))
    assert_one_line_refusal(code, out, err, str(missing))


def test_flips_parse_to_checked_lever_values():
    assert parse_flips([]) == {}
    flips = parse_flips(["bisect_no_mix=true", " max_prefill_tokens = 64", "bisect_no_mix=false"])
    assert flips == {"bisect_no_mix": False, "max_prefill_tokens": 64}, "the last flip of a lever wins"


@pytest.mark.parametrize("item, words", [
    ("bisect_no_mix", "expected NAME=VALUE"),
    ("=true", "expected NAME=VALUE"),
    ("no_such_lever=1", "unknown lever 'no_such_lever'"),
    ("max_prefill_tokens=-1", "max_prefill_tokens"),
    ("bisect_no_mix=perhaps", "bisect_no_mix"),
])
def test_a_bad_flip_is_a_levers_error_naming_it(item, words):
    with pytest.raises(LeversError, match=words):
        parse_flips([item])
