"""Bundle workload.jsonl round trip and the --workload parser."""
import json

import pytest

from engine.workload.bundle import BundleWorkload, read_workload_jsonl, write_workload_jsonl
from engine.workload.multiturn import MultiTurnWorkload
from engine.workload.parse import parse_workload
from engine.workload.request import WorkloadError
from engine.workload.synthetic import SyntheticWorkload
from engine.workload.trace import TraceWorkload


def line(**kw):
    obj = {"request_id": 0, "arrival_tick": 0, "arrival_s": 0.0, "prompt_tokens": [1, 2],
           "sampling": {"temperature": 0.0, "max_tokens": 4}, "seed": None}
    obj.update(kw)
    return json.dumps(obj)


def test_round_trip_of_a_generated_workload(tmp_path):
    specs = MultiTurnWorkload(vocab_size=100, num_conversations=2, num_turns=2).requests()
    for i, s in enumerate(specs):
        s.arrival_tick = i * 3
    path = tmp_path / "workload.jsonl"
    write_workload_jsonl(specs, path)
    assert read_workload_jsonl(path) == specs
    served = BundleWorkload(tmp_path).requests()     # a bundle directory works too
    assert {s.features["source"] for s in served} == {"replay"}   # served again: the Requests page's source filter
    unmarked = [{**vars(s), "features": {k: v for k, v in s.features.items() if k != "source"} or None} for s in served]
    assert unmarked == [{**vars(s), "features": s.features or None} for s in specs]


def test_sorted_by_tick_and_top_level_seed_fills_sampling(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join([line(request_id=5, arrival_tick=9, arrival_s=0.9, seed=11),
                               line(request_id=2, arrival_tick=1, arrival_s=0.1), ""]))
    specs = BundleWorkload(path).requests()
    assert [s.request_id for s in specs] == [2, 5]
    assert specs[1].sampling["seed"] == 11 and specs[0].sampling.get("seed") is None
    specs[0].prompt_tokens.append(99)  # copies: the next replay is unchanged
    assert BundleWorkload(path).requests()[0].prompt_tokens == [1, 2]
    assert BundleWorkload(path).describe()["has_ticks"] is True


@pytest.mark.parametrize("text, message", [
    ("{not json", "line 1: not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (line().replace('"prompt_tokens": [1, 2], ', ""), "missing field 'prompt_tokens'"),
    (line(prompt_tokens=[]), "prompt_tokens must be a non-empty list"),
    (line(prompt_tokens=[1, "a"]), "prompt_tokens must be a non-empty list"),
    (line(arrival_s=-1), "arrival_s must be"),
    (line(arrival_tick=1.5), "arrival_tick must be"),
    (line(sampling=3), "sampling must be a JSON object"),
    (line(sampling={"temperature": 0.0}), "sampling.max_tokens is missing"),
    (line() + "\n" + line(), "line 2: request_id 0 repeats"),
    ("", "no requests"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, text, message):
    path = tmp_path / "workload.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message) as info:
        read_workload_jsonl(path)
    assert str(path) in str(info.value)


def test_tokens_outside_vocab_and_missing_file(tmp_path):
    path = tmp_path / "workload.jsonl"
    path.write_text(line(prompt_tokens=[3, 700]))
    with pytest.raises(WorkloadError, match="700, outside the vocabulary"):
        BundleWorkload(path, vocab_size=500)
    with pytest.raises(WorkloadError, match="cannot read"):
        BundleWorkload(tmp_path / "missing.jsonl")


def test_parse_workload_kinds(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,8,2\n2023-11-16 18:15:48,4,2\n")
    w = parse_workload(f"trace:{csv}", vocab_size=50, time_scale=0.5, limit=None)
    assert isinstance(w, TraceWorkload) and [s.arrival_s for s in w] == [0.0, 1.0]
    s = parse_workload("synthetic", vocab_size=50, num_requests=3, seed=None)
    assert isinstance(s, SyntheticWorkload) and len(list(s)) == 3
    assert isinstance(parse_workload("multiturn", vocab_size=50, num_turns=2), MultiTurnWorkload)
    jsonl = tmp_path / "workload.jsonl"
    jsonl.write_text(line())
    assert len(list(parse_workload(f"bundle:{jsonl}", vocab_size=50))) == 1


@pytest.mark.parametrize("spec, opts, message", [
    ("poisson", {}, "unknown workload 'poisson'"),
    ("", {}, "workload must be one of"),
    ("trace", {"vocab_size": 5}, "needs a file: trace:PATH"),
    ("synthetic:x", {"vocab_size": 5}, "takes no path"),
    ("synthetic", {}, "needs vocab_size"),
    ("synthetic", {"vocab_size": 5, "time_scale": 0.5}, r"does not take option\(s\) \['time_scale'\]"),
    ("bundle:x.jsonl", {"rate": 2}, r"\['rate'\]"),
])
def test_parse_workload_errors(spec, opts, message):
    with pytest.raises(WorkloadError, match=message):
        parse_workload(spec, **opts)
