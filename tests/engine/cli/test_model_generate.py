"""``python -m engine generate``: the JSON contract, greedy determinism, seeded sampling, bad input -> exit 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.__main__ import main


@pytest.fixture(autouse=True)
def tiny_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CHUNKSCOPE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_json_contract_and_determinism(capsys):
    code, out, err = run_cli(capsys, "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "12",
                             "--json", "--ignore-eos")
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == {"tokens", "text", "finish_reason"} and len(result["tokens"]) == 12
    assert all(isinstance(t, int) and 0 <= t < 272 for t in result["tokens"])
    assert isinstance(result["text"], str)
    assert json.loads(run_cli(capsys, "--prompt-ids", "1,2,3", "--max-tokens", "12", "--json",
                              "--ignore-eos")[1]) == result


def test_greedy_matches_runner_argmax(capsys):
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner
    from engine.cache.sequence import SequenceState
    model, _, _ = load_model("tiny")
    runner = ModelRunner.build(model, 4, 1)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    tokens = [int(runner.prefill_chunk(seq, [5, 6, 7, 8], 0, 4, True).argmax())]
    for _ in range(5):
        tokens.append(int(runner.decode([seq], [tokens[-1]])[0].argmax()))
    out = run_cli(capsys, "--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--json", "--ignore-eos")[1]
    assert json.loads(out)["tokens"] == tokens


def test_seeded_sampling_replays_and_text_prompt_works(capsys):
    args = ["--prompt", "hello world", "--max-tokens", "16", "--temperature", "1.0", "--top-k", "50",
            "--top-p", "0.9", "--min-p", "0.01", "--seed", "11", "--json", "--ignore-eos"]
    first = json.loads(run_cli(capsys, *args)[1])
    second = json.loads(run_cli(capsys, *args)[1])
    assert first == second and len(first["tokens"]) == 16
    other = json.loads(run_cli(capsys, *args[:-3], "12", "--json", "--ignore-eos")[1])
    assert other["tokens"] != first["tokens"]


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,2,999"], "outside the vocabulary"),
    (["--prompt-ids", ""], "prompt is empty"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "top_p"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens"),
    (["--prompt-ids", "1", "--prompt", "a"], "exactly one of"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_broken_checkpoint_dir_exits_2(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = run_cli(capsys, "--model", str(tmp_path), "--prompt-ids", "1")
    assert code == 2 and "unknown architecture" in err and err.count("\n") == 1


def test_module_entry_point_runs_as_subprocess(tmp_path_factory):
    env_cache = str(tmp_path_factory.getbasetemp() / "cache")
    proc = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt-ids", "1,2", "--max-tokens",
                           "3", "--json", "--ignore-eos"], capture_output=True, text=True, timeout=120,
                          env={"CHUNKSCOPE_CACHE": env_cache, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 3
    bad = subprocess.run([sys.executable, "-m", "engine", "generate", "--max-tokens", "nope"],
                         capture_output=True, text=True, timeout=120, env={"OMP_NUM_THREADS": "1"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("kind", ["off", "ngram", "mtp", "self"])
def test_speculation_adds_spec_counts_and_keeps_the_tokens(capsys, kind):
    base = ["--prompt-ids", "40,41,42,43,40,41,42,43", "--max-tokens", "24", "--json", "--ignore-eos"]
    plain = json.loads(run_cli(capsys, *base)[1])
    code, out, err = run_cli(capsys, *base, "--speculation", kind, "--num-speculative-tokens", "3")
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == plain["tokens"]
    spec = result["spec"]
    assert set(spec) == {"drafted", "accepted", "steps"}
    if kind == "off":
        assert spec == {"drafted": 0, "accepted": 0, "steps": 0}
    else:
        assert spec["steps"] > 0 and 0 <= spec["accepted"] <= spec["drafted"] <= 3 * spec["steps"]


def test_speculation_bad_k_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:  # an argparse error
        run_cli(capsys, "--prompt-ids", "1,2", "--speculation", "mtp", "--num-speculative-tokens", "9")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--num-speculative-tokens" in err and "[1, 8]" in err
