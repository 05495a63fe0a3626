"""``--ep 2`` gives the tokens ``--ep 1`` gives: generate (greedy, seeded) and a serving run with
chunked prompts and preemptions, through real rank processes over gloo."""
from __future__ import annotations

import json
import sqlite3

import pytest

from engine.distributed.exchange import token_slices
from tests.engine.ep_process import PROMPT, engine, is_running, tokens_by_request


GENERATE = ["generate", "--model", "tiny-moe", "--prompt-ids", PROMPT, "--max-tokens", "20", "--ignore-eos",
            "--json", "--threads", "1"]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.9", "--top-p", "0.9", "--seed", "7"]],
                         ids=["greedy", "seeded"])
def test_generate_ep2_matches_ep1(sampling):
    results = {}
    for ep in ("1", "2"):
        done = engine(*GENERATE, *sampling, "--ep", ep)
        assert done.returncode == 0, done.stderr[-3000:]
        results[ep] = json.loads(done.stdout)["tokens"]
    assert len(results["1"]) == 20
    assert results["2"] == results["1"]


def test_generate_all_gather_exchange_matches_and_four_ranks():
    one = json.loads(engine(*GENERATE, "--ep", "1").stdout)["tokens"]
    for extra in (["--ep", "2", "--ep-exchange", "all_gather"], ["--ep", "4"]):
        done = engine(*GENERATE, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["tokens"] == one


def _serve(run_dir, ep: str) -> sqlite3.Connection:
    done = engine("serve", "--model", "tiny-moe", "--run-dir", str(run_dir), "--requests", "10", "--rate", "100000",
                  "--seed", "3", "--kv-blocks", "24", "--ep", ep, CHUNKSCOPE_MAX_PREFILL_TOKENS="32")
    assert done.returncode == 0, done.stderr[-3000:]
    return sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)


def test_serving_ep2_matches_ep1_with_chunked_prompts_and_preemptions(tmp_path):
    one, two = _serve(tmp_path / "ep1", "1"), _serve(tmp_path / "ep2", "2")
    for conn in (one, two):
        assert conn.execute("SELECT count(*) FROM preemptions").fetchone()[0] > 0
        assert conn.execute("SELECT count(*) FROM chunks WHERE offset > 0").fetchone()[0] > 0  # chunked prompts
    # Half of the synthetic requests sample with a seed, half are greedy: both kinds compared.
    assert tokens_by_request(tmp_path / "ep2" / "telemetry.db") == tokens_by_request(tmp_path / "ep1" / "telemetry.db")
    statuses = "SELECT request_id, status FROM requests ORDER BY request_id"
    assert two.execute(statuses).fetchall() == one.execute(statuses).fetchall()

    # The reference's rules: no chunk mixes under EP; every computed chunk was broadcast first.
    assert two.execute("SELECT count(*) FROM chunks WHERE path = 'mixed'").fetchone()[0] == 0
    assert two.execute("SELECT count(*) FROM chunks WHERE mix_blocker = 'expert_parallel'").fetchone()[0] > 0
    unbroadcast = "SELECT count(*) FROM chunks WHERE outcome = 'ok' AND ep_broadcast_ns IS NULL"
    assert two.execute(unbroadcast).fetchone()[0] == 0
    assert one.execute("SELECT count(*) FROM chunks WHERE ep_broadcast_ns IS NOT NULL").fetchone()[0] == 0
    # Per-rank timings of every forward reach rank 0's store.
    ranks = two.execute("SELECT json_extract(detail, '$.rank'), count(*), min(json_extract(detail, '$.forward_ns')) "
                        "FROM events WHERE kind = 'ep_forward' GROUP BY 1 ORDER BY 1").fetchall()
    num_forwards = two.execute("SELECT count(*) FROM ticks WHERE path != 'idle'").fetchone()[0]
    assert [(r, n) for r, n, _ in ranks] == [(0, num_forwards), (1, num_forwards)]
    assert all(fwd > 0 for *_, fwd in ranks)
    run = json.loads(two.execute("SELECT config FROM runs").fetchone()[0])
    assert run["ep"]["ranks"] == 2 and not any(is_running(pid) for pid in run["ep"]["rank_pids"].values())
    assert two.execute("SELECT status FROM runs").fetchone()[0] == "finished"
    _check_rank_lanes(tmp_path / "ep2" / "telemetry.db", tmp_path / "ep1" / "telemetry.db")


def _check_rank_lanes(ep2_db, ep1_db):
    """The Live timeline draws one lane per rank from the ep_forward events (none without EP)."""
    from dashboard.figures.charts import timeline_figure
    from dashboard.queries.live import timeline_window

    for db, lanes in ((ep2_db, ["rank 0", "rank 1"]), (ep1_db, [])):
        win = timeline_window(db, 1, 3600.0)
        fig = timeline_figure(win.forwards, win.stream_events, win.links, win.preemptions, win.lever_changes,
                              (win.start_ms, win.end_ms), rank_forwards=win.rank_forwards)
        assert [name for name in fig.layout.yaxis.ticktext if name.startswith("rank")] == lanes
        assert sorted(win.rank_forwards["rank"].unique().tolist()) == [0, 1][:len(lanes)]
        bars = [t for t in fig.data if t.name == "rank exchange"]
        assert (len(bars) == 1 and len(bars[0].x) == len(win.rank_forwards)) if lanes else not bars


def test_token_slices_cover_every_token_once():
    for tokens in range(0, 40):
        for size in (1, 2, 3, 4):
            slices = token_slices(tokens, size)
            assert slices[0][0] == 0 and slices[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
            assert max(b - a for a, b in slices) - min(b - a for a, b in slices) <= 1


def test_torchrun_started_ranks_give_the_same_tokens():
    """The same command under torchrun: its env names the ranks, rank > 0 becomes a worker, rank 0 prints."""
    import socket
    import subprocess
    import sys

    from tests.engine.ep_process import REPO_ROOT, clean_env, kill_group

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(port), "-m", "engine", *GENERATE, "--ep", "2"],
                            cwd=REPO_ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    assert json.loads(lines[0])["tokens"] == json.loads(engine(*GENERATE, "--ep", "1").stdout)["tokens"]


def test_serving_ep2_matches_ep1_with_prefix_snapshots_and_speculation(tmp_path):
    """SSM state rank 0 writes outside a forward (prefix snapshot restores, speculative roll-backs)
    reaches the other ranks before the next forward: otherwise the tokens would drift."""
    env = {"CHUNKSCOPE_SSM_TAIL_CKPT": "1", "CHUNKSCOPE_SPECULATION": "ngram"}
    conns = {}
    for ep in ("1", "2"):
        run_dir = tmp_path / f"ep{ep}"
        done = engine("serve", "--model", "tiny-moe", "--run-dir", str(run_dir), "--workload", "multiturn",
                      "--requests", "12", "--rate", "100000", "--seed", "5", "--kv-blocks", "64", "--ep", ep, **env)
        assert done.returncode == 0, done.stderr[-3000:]
        conns[ep] = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
    kinds = "SELECT kind, count(*) FROM events WHERE kind IN ('snapshot_restored', 'spec_step') GROUP BY kind"
    assert dict(conns["2"].execute(kinds).fetchall()).keys() == {"snapshot_restored", "spec_step"}
    assert tokens_by_request(tmp_path / "ep2" / "telemetry.db") == tokens_by_request(tmp_path / "ep1" / "telemetry.db")


def test_generate_ep2_matches_ep1_with_images(tmp_path):
    """A Qwen3.5-MoE checkpoint with a vision tower: rank 0 runs the tower, the image rows reach rank 1
    after each chunk's broadcast (``vision_sync.py``), and the tokens equal one rank's."""
    pytest.importorskip("transformers")
    from tests.engine.model.vision_checkpoints import build_vl_checkpoint, png_bytes

    _, directory = build_vl_checkpoint("vl_moe", lambda name: tmp_path / name)
    images = []
    for i, size in enumerate([(40, 56), (24, 33)]):
        images += ["--image", str(tmp_path / f"{i}.png")]
        (tmp_path / f"{i}.png").write_bytes(png_bytes(*size, i))
    command = ["generate", "--model", str(directory), "--prompt-ids", "1,2,3,4,5", *images, "--max-tokens", "12",
               "--ignore-eos", "--json", "--threads", "1"]
    results = {}
    for ep in ("1", "2"):
        done = engine(*command, "--ep", ep)
        assert done.returncode == 0, done.stderr[-3000:]
        results[ep] = json.loads(done.stdout)["tokens"]
    assert len(results["1"]) == 12 and results["2"] == results["1"]


def test_serving_ep2_matches_ep1_with_workload_images_and_the_sync_on_chunk_rows(tmp_path):
    """The synthetic workload puts an image in front of half the prompts (the default on a vision
    checkpoint); chunks of 16 split them; every chunk that covered image rows records its sync."""
    pytest.importorskip("transformers")
    from tests.engine.model.vision_checkpoints import build_vl_checkpoint

    _, directory = build_vl_checkpoint("vl_moe", lambda name: tmp_path / name)
    dbs = {}
    for ep in ("1", "2"):
        run_dir = tmp_path / f"ep{ep}"
        done = engine("serve", "--model", str(directory), "--run-dir", str(run_dir), "--requests", "6", "--rate",
                      "100000", "--seed", "5", "--kv-blocks", "48", "--ep", ep, CHUNKSCOPE_MAX_PREFILL_TOKENS="16")
        assert done.returncode == 0, done.stderr[-3000:]
        dbs[ep] = run_dir / "telemetry.db"
    assert tokens_by_request(dbs["2"]) == tokens_by_request(dbs["1"])
    two = sqlite3.connect(f"file:{dbs['2']}?mode=ro", uri=True)
    assert two.execute("SELECT count(*) FROM requests WHERE num_images = 1").fetchone()[0] >= 2
    spans = two.execute("SELECT image_spans, ep_vision_sync_ns FROM chunks WHERE outcome = 'ok'").fetchall()
    with_images = [sync for span, sync in spans if span]
    assert len(with_images) >= 4 and all(sync is not None and sync > 0 for sync in with_images)
    assert all(sync is None for span, sync in spans if not span)
