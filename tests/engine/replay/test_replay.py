"""Replay of a real served run: identical decisions and tokens, the lever timeline keyed by tick,
flipped levers checked against a direct run, and bad bundles refused in one line."""
from __future__ import annotations

import copy
import dataclasses
import json
import socket
import sqlite3
from collections import deque
from types import SimpleNamespace

import httpx
import pytest
import torch

from engine.__main__ import main
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.replay import flips as replay_flips
from engine.replay.rerun import load_input, replay_run
from engine.replay.record import ReplayInputError
from engine.replay.compare import compare
from engine.scheduler.loop import Scheduler
from telemetry.bundle_export import export_bundle
from telemetry.levers import defaults, write_levers_file

from serve_process import kill_quietly, max_tick, query, scalar, start_serve, stop, wait_for

CONTRACT_KEYS = {"decisions_identical", "tokens_identical", "first_divergence", "requests"}
REQUEST_KEYS = {"request_id", "tokens_identical", "first_token_diff", "recorded_len", "replayed_len",
                "status_recorded", "status_replayed"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real serve run (endless synthetic workload), a lever written mid-run, stopped by SIGTERM."""
    run_dir = tmp_path_factory.mktemp("served")
    db = run_dir / "telemetry.db"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = start_serve(run_dir, "--rate", "8", "--seed", "5", "--api-port", str(port))
    try:
        wait_for(lambda: max_tick(db) >= 15 and scalar(db, "SELECT count(*) FROM chunks WHERE path='mixed'"),
                 "15 ticks and a mixed chunk", proc)
        write_levers_file(run_dir / "levers.json", 1, {"max_prefill_tokens": 32})
        change = wait_for(lambda: query(db, "SELECT * FROM lever_changes WHERE name='max_prefill_tokens' "
                                            "AND status='applied'"), "the lever change", proc)[0]
        wait_for(lambda: scalar(db, "SELECT count(*) FROM chunks WHERE tick > ? AND cap_rule='max_prefill_tokens'",
                                (change["tick"],)) and max_tick(db) >= change["tick"] + 20,
                 "chunks capped by the new lever", proc)
        # A long API request decoding at the stop: the recording holds a request cancelled at shutdown
        # whatever the machine's speed (the synthetic ones may all have finished by then on a fast one).
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "cut me short", "max_tokens": 1000,
                                "min_tokens": 1000, "stream": True}) as reply:
            assert reply.status_code == 200, reply.read()
            next(line for line in reply.iter_lines() if line.startswith("data:"))   # its first token
            status, stderr = stop(proc)
    finally:
        kill_quietly(proc)
    assert status == 0, stderr
    bundle = export_bundle(db, run_dir / "bundle.zip").path
    return SimpleNamespace(run_dir=run_dir, db=db, bundle=bundle, change=change)


@pytest.fixture(scope="module")
def recorded(served):
    run, manifest = load_input(str(served.bundle))
    assert manifest is not None and manifest["run"]["status"] == "finished"
    return run


@pytest.fixture(scope="module")
def replayed(recorded):
    return replay_run(recorded, model="tiny")


CUT_SHORT_STATUSES = {"waiting", "prefilling", "decoding", "cancelled"}


def cut_short(r) -> bool:
    """The recording ended before this request could: still in flight at the stop, or cancelled."""
    return r.status in CUT_SHORT_STATUSES or bool(r.error and r.error.startswith("cancelled:"))


def direct_run(recorded, flips: dict) -> dict[int, list[int]]:
    """The flipped config straight through a Scheduler, written independently of engine.replay:
    per tick, arrivals, then lever changes (the flip winning), then the cut, then one step; every
    request runs to its end except those the recording cut short (in flight or cancelled when it
    stopped): they end where the recording did, and one cut before its first token never samples it."""
    # The recording's dtype: ``--dtype auto`` is bf16 on a CPU with native bf16 multiplies.
    dtype = getattr(torch, recorded.config["dtype"])
    model, _, _ = load_model("tiny", dtype=dtype)
    runner = ModelRunner.build(model, num_kv_blocks=recorded.config["kv_blocks"], dtype=dtype,
                               num_ssm_slots=recorded.config["ssm_slots"], block_size=recorded.config["block_size"])
    sched = Scheduler(runner, defaults().replace(**{**recorded.start_levers, **flips}),
                      run_seed=recorded.config["seed"])
    arrivals = deque(sorted(recorded.requests, key=lambda r: (r.arrival_tick, r.arrival_ns, r.request_id)))
    submitted = []
    changes = {}
    for change in recorded.lever_changes:
        changes.setdefault(change.tick, {})[change.name] = change.new
    recorded_tokens = recorded.output_tokens()
    stop_after = {r.request_id: len(recorded_tokens.get(r.request_id, [])) for r in recorded.requests
                  if cut_short(r)}

    def submit(r):
        submitted.append(sched.submit(r.request_id, list(r.prompt_tokens), dict(r.sampling),
                                      conversation_id=r.conversation_id, features=r.features or None,
                                      grammar=r.grammar, grammar_ready_tick=getattr(r, "grammar_ready_tick", None)))

    def cut():
        prefilling = [sched.prefilling] if sched.prefilling is not None else []
        for request in [*sched.active, *prefilling]:
            if request.num_generated >= stop_after.get(request.request_id, 1 << 30):
                sched.cancel(request.request_id, "the recording stopped here")
        for request in [*sched.waiting, *([sched.prefilling] if sched.prefilling is not None else [])]:
            if stop_after.get(request.request_id) == 0:   # token 0 would already be one too many
                sched.cancel(request.request_id, "the recording stopped here")

    while True:
        while arrivals and arrivals[0].arrival_tick <= sched.tick:
            submit(arrivals.popleft())
        for tick in sorted(t for t in changes if t <= sched.tick):
            sched.apply_levers(sched.levers.replace(**{**changes.pop(tick), **flips}), source="test")
        cut()
        if sched.has_work and sched.step():
            continue
        if not arrivals:
            break
        submit(arrivals.popleft())
    sched.stop()
    return {r.request_id: r.output_tokens for r in submitted}


def expected_first_diffs(recorded, direct: dict[int, list[int]]) -> dict[int, int | None]:
    """Per request: first index where the recording and the direct run differ (prefix only for
    requests the recording cut short)."""
    out = {}
    tokens = recorded.output_tokens()
    for r in recorded.requests:
        mine, theirs = tokens.get(r.request_id, []), direct[r.request_id]
        if cut_short(r):
            theirs = theirs[:len(mine)]
        diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if diff is None and len(mine) != len(theirs):
            diff = min(len(mine), len(theirs))
        out[r.request_id] = diff
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["replay", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_replay_of_a_served_bundle_is_identical(served, recorded, replayed):
    samplings = [r.sampling for r in recorded.requests]
    assert any(s["temperature"] == 0 for s in samplings) and any(s["temperature"] > 0 for s in samplings)
    assert all(s["seed"] is not None for s in samplings if s["temperature"] > 0)
    assert sum(len(t) for t in recorded.output_tokens().values()) > 50
    report = compare(recorded, replayed)
    assert report["first_divergence"] is None, report["first_divergence"]
    assert report["decisions_identical"] and report["tokens_identical"] and report["statuses_identical"]
    assert len(replayed.chunks) == len(recorded.chunks) and len(replayed.ticks) == len(recorded.ticks)
    # The mid-run file change was replayed at the tick the engine applied it.
    assert {"tick": served.change["tick"], "changes": {"max_prefill_tokens": 32}} in replayed.lever_log


def test_the_lever_timeline_is_what_makes_it_identical(served, recorded):
    without = replay_run(dataclasses.replace(recorded, lever_changes=[]), model="tiny")
    report = compare(recorded, without)
    assert not report["decisions_identical"]
    first = report["first_divergence"]
    assert first["tick"] >= served.change["tick"], first


def test_json_cli_reports_the_contract(served, capsys):
    status, out, err = run_cli(capsys, str(served.bundle), "--json")
    assert status == 0, err
    report = json.loads(out)
    assert CONTRACT_KEYS <= set(report)
    assert report["decisions_identical"] is True and report["tokens_identical"] is True
    assert report["first_divergence"] is None
    assert report["requests"] and all(REQUEST_KEYS <= set(r) for r in report["requests"])
    status, out, _ = run_cli(capsys, str(served.bundle))
    assert status == 0 and "decisions: identical" in out and "first divergence: none" in out
    assert f"levers applied at tick {served.change['tick']}: max_prefill_tokens=32" in out
    stall = report["stall"]      # every recorded change replayed; blocked time and TTFT p99 side by side
    assert stall["lever_changes"]["recorded"] == stall["lever_changes"]["replayed"] >= 1
    assert stall["blocked_s"]["recorded"] == 0 and stall["ttft_p99_ms"]["recorded"] > 0
    assert stall["ttft_p99_ms"]["replayed"] > 0 and stall["lines"][-1].startswith("TTFT p99: ")
    n = stall["lever_changes"]["recorded"]
    assert f"lever changes: {n} recorded, {n} replayed" in out and "blocked: never in the recording" in out


@pytest.mark.parametrize("flip, value", [("bisect_no_mix", True), ("kv_blocks_cap", 12)])
def test_flipped_replay_matches_a_direct_run(served, recorded, capsys, flip, value):
    status, out, err = run_cli(capsys, str(served.bundle), "--json", "--flip", f"{flip}={str(value).lower()}")
    assert status == 0, err
    report = json.loads(out)
    assert report["flips"] == {flip: value}
    assert report["decisions_identical"] is False
    expected = expected_first_diffs(recorded, direct_run(recorded, {flip: value}))
    assert {r["request_id"]: r["first_token_diff"] for r in report["requests"]} == expected
    assert report["tokens_identical"] == all(d is None for d in expected.values())
    if flip == "bisect_no_mix":  # mixing changes no token (batch invariance)
        assert report["tokens_identical"], [r for r in report["requests"] if not r["tokens_identical"]]
    else:  # a tiny KV cap preempts: the report must find the requests that lost tokens
        assert any(d is not None for d in expected.values())


def test_a_tampered_recording_points_at_its_first_divergence(recorded, replayed):
    chunk_index = len(recorded.chunks) // 2
    tampered = copy.deepcopy(recorded)
    target = tampered.chunks[chunk_index]
    target.length += 1
    report = compare(tampered, replayed)
    assert not report["decisions_identical"] and report["tokens_identical"]
    assert report["first_divergence"] == {"tick": target.tick, "request_id": target.request_id,
                                          "field": "chunk.length", "recorded": target.length,
                                          "replayed": target.length - 1}
    tampered = copy.deepcopy(recorded)
    token = next(t for t in tampered.tokens if t.index == 2)
    token.token_id = (token.token_id + 1) % 256
    report = compare(tampered, replayed)
    assert report["decisions_identical"] and not report["tokens_identical"]
    row = next(r for r in report["requests"] if r["request_id"] == token.request_id)
    assert row["first_token_diff"] == 2 and not row["tokens_identical"]
    assert report["first_divergence"]["field"] == "output_tokens[2]"
    assert report["first_divergence"]["tick"] == token.tick


def _copy_db(served, tmp_path, sql: str):
    db = tmp_path / "telemetry.db"
    source, target = sqlite3.connect(served.db), sqlite3.connect(db)
    source.backup(target)  # the WAL's pages too, which a file copy could miss
    source.close()
    with target:
        target.execute(sql)
    target.close()
    return db


def test_bad_inputs_exit_2_with_one_line(served, tmp_path, capsys):
    garbage = tmp_path / "garbage.zip"
    garbage.write_bytes(b"PK\x03\x04 not really a zip" * 10)
    windowed = export_bundle(served.db, tmp_path / "window.zip", since_s=0.5).path
    cases = [
        ([str(tmp_path / "missing.zip")], "no such bundle"),
        ([str(garbage)], "garbage.zip"),
        ([str(windowed)], "windowed"),
        ([str(_copy_db(served, tmp_path, "UPDATE runs SET schema_version = 99"))], "newer"),
        ([str(served.bundle), "--flip", "bisect_no_mix=maybe"], "bisect_no_mix"),
        ([str(served.bundle), "--flip", "no_such_lever=1"], "unknown lever"),
    ]
    for argv, needle in cases:
        status, out, err = run_cli(capsys, *argv)
        assert status == 2 and out == "", (argv, out, err)
        assert len(err.strip().splitlines()) == 1 and needle in err, (argv, err)
        assert "Traceback" not in err


def test_a_different_checkpoint_is_refused_unless_asked(served, tmp_path, capsys):
    db = _copy_db(served, tmp_path, "UPDATE runs SET checkpoint_hash = 'f00d' || checkpoint_hash")
    status, out, err = run_cli(capsys, str(db), "--json")
    assert status == 2 and "hash" in err and len(err.strip().splitlines()) == 1
    status, out, err = run_cli(capsys, str(db), "--json", "--ignore-checkpoint-hash")
    assert status == 0 and "warning" in err and json.loads(out)["tokens_identical"] is True


def test_a_no_op_flip_says_so_and_replays_as_recorded(served, recorded, capsys):
    """bisect_no_mix was false from tick 0 and never changed: flipping it to false is a plain replay
    (it used to run past the recorded end, where a request cancelled at shutdown finished: DIFFERENT)."""
    assert recorded.start_levers.get("bisect_no_mix", False) is False
    status, out, err = run_cli(capsys, str(served.bundle), "--json", "--flip", "bisect_no_mix=false")
    assert status == 0, err
    assert "--flip bisect_no_mix=False changes nothing" in err
    report = json.loads(out)
    assert report["flips"] == {}
    assert report["decisions_identical"] and report["tokens_identical"] and report["statuses_identical"]
    assert any("changes nothing" in note for note in report["notes"])


def test_a_flipped_replay_stops_each_request_where_the_recording_did(served, recorded, capsys):
    cut = [r for r in recorded.requests if r.status == "cancelled"]
    assert cut, "the SIGTERM'd recording should hold requests cancelled at shutdown"
    status, out, err = run_cli(capsys, str(served.bundle), "--json", "--flip", "bisect_no_mix=true")
    assert status == 0, err
    report = json.loads(out)
    rows = {r["request_id"]: r for r in report["requests"]}
    for request in cut:
        row = rows[request.request_id]
        assert row["status_replayed"] == "cancelled" and row["replayed_len"] == row["recorded_len"], row
    assert report["statuses_identical"] and report["tokens_identical"]


def test_a_flip_the_model_cannot_honour_is_refused(served, hf_checkpoint, capsys):
    # tiny has an MTP module; a checkpoint without mtp.* tensors (transformers writes none) has not.
    no_mtp, _, _ = load_model(hf_checkpoint("base")[1])
    with pytest.raises(ReplayInputError) as refused:
        replay_flips.check_model_can_honour({"speculation": "mtp"}, no_mtp)
    assert str(refused.value).startswith("--flip speculation=mtp: speculation=mtp needs a multi-token-prediction "
                                         "head; the loaded model has none (config.json declares no MTP module")
    tiny, _, _ = load_model("tiny")
    replay_flips.check_model_can_honour({"speculation": "mtp"}, tiny)  # no error: tiny drafts with its MTP
    capsys.readouterr()  # building the checkpoint above printed progress
    status, out, err = run_cli(capsys, str(served.bundle), "--flip", "speculation=eagle")
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and "speculation" in err