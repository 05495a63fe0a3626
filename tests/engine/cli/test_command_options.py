"""The commands' options as values: the engine's argument types, the KV cache options (and the recorded
run's as fallback), generate's prompt and grammar parsing, and every command registered once."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from engine.__main__ import COMMANDS, OneLineParser, one_line
from engine.cache.kv_options import OPTION_KEYS, budget_bytes, kv_quant_config
from engine.cli import args as cli_args
from engine.cli.generate import grammar_from_args, parse_ids, runner_sizes
from engine.cli.kv_cache_args import add_kv_cache_args, kv_cache_options


@pytest.mark.parametrize("parse, text, value", [
    (cli_args.seed, "0", 0), (cli_args.seed, str(2**63 - 1), 2**63 - 1), (cli_args.positive_int, " 7 ", 7),
    (cli_args.non_negative_int, "0", 0), (cli_args.positive_float, "0.5", 0.5), (cli_args.finite_float, "-3", -3.0),
])
def test_the_engines_argument_types_accept(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize("parse, text, words", [
    (cli_args.seed, "-1", "outside"), (cli_args.seed, str(2**63), "outside"), (cli_args.positive_int, "0", "outside"),
    (cli_args.positive_int, "1.5", "not an integer"), (cli_args.positive_float, "0", "outside"),
    (cli_args.finite_float, "nan", "outside"), (cli_args.finite_float, "inf", "outside"),
])
def test_the_engines_argument_types_refuse_in_one_line(parse, text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        parse(text)


def parsed(*argv: str, from_run: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kv_cache_args(parser, from_run=from_run)
    return parser.parse_args(list(argv))


def test_kv_cache_options_default_to_full_precision_and_fall_back_to_the_run():
    assert kv_cache_options(parsed()) == {"kv_cache_dtype": "auto", **{k: None for k in OPTION_KEYS[1:]}}
    recorded = {"kv_cache_dtype": "innerq4", "kv_cache_mb": 2.0, "kv_recent_tokens": 64}
    options = kv_cache_options(parsed("--kv-recent-tokens", "32", from_run=True), recorded)
    assert options["kv_cache_dtype"] == "innerq4" and options["kv_cache_mb"] == 2.0
    assert options["kv_recent_tokens"] == 32   # the command line wins over the recording
    assert kv_quant_config(options).recent_tokens == 32 and budget_bytes(options) == 2 << 20
    assert kv_quant_config({"kv_cache_dtype": "auto"}) is None and budget_bytes({}) is None


def test_bad_kv_cache_values_fail_before_a_model_loads():
    with pytest.raises(SystemExit):
        parsed("--kv-cache-mb", "0")
    with pytest.raises(ValueError):
        kv_cache_options(parsed("--kv-cache-dtype", "innerq4", "--kv-group-size", "7"))


def test_generate_reads_prompt_ids_and_sizes_one_sequence():
    assert parse_ids("1, 2,3,") == [1, 2, 3] and parse_ids("") == []
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_ids("1,x")
    assert runner_sizes(prompt_len=10, max_tokens=6) == (2, 1)
    assert runner_sizes(prompt_len=16, max_tokens=1) == (3, 1)


def test_generate_takes_at_most_one_grammar(tmp_path):
    none = SimpleNamespace(json_schema=None, regex=None, choice=None)
    assert grammar_from_args(none) is None
    assert grammar_from_args(SimpleNamespace(**{**vars(none), "choice": "a,,b"})) == {"kind": "choice",
                                                                                     "value": ["a", "b"]}
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "integer"}))
    assert grammar_from_args(SimpleNamespace(**{**vars(none), "json_schema": str(schema)}))["value"] == {
        "type": "integer"}
    schema.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        grammar_from_args(SimpleNamespace(**{**vars(none), "json_schema": str(schema)}))
    with pytest.raises(ValueError, match="at most one"):
        grammar_from_args(SimpleNamespace(json_schema=None, regex="a", choice="b"))


def test_every_command_registers_once_with_its_run():
    parser = OneLineParser(prog="python -m engine")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    assert sorted(subparsers.choices) == ["generate", "replay", "serve"]
    serve = parser.parse_args(["serve", "--run-dir", "x"])
    assert serve.func.__module__ == "engine.serve.process" and serve.kv_blocks == 512 and serve.compile == "auto"
    replay = parser.parse_args(["replay", "bundle.zip", "--flip", "bisect_no_mix=true"])
    assert replay.func.__module__ == "engine.cli.replay" and replay.kv_cache_dtype is None


def test_an_error_is_one_line():
    assert one_line(ValueError("a\n  b")) == "a b"
    assert one_line(FileNotFoundError(2, "No such file or directory", "/x/" + "y" * 300)).startswith(
        "No such file or directory: /x/")
    assert len(one_line(FileNotFoundError(2, "No such file", "/" + "y" * 300))) < 180
    assert one_line(RuntimeError()) == "RuntimeError"
