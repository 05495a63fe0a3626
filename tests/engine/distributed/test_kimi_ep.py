"""Kimi Linear under expert parallelism: ``--ep 2`` gives the tokens ``--ep 1`` gives (real rank processes, gloo).

The dense first MLP and the KDA / MLA layers are replicated; the sparse layers' experts split
4 + 4 and their rows are summed in one fixed order, so the bits agree.
"""
from __future__ import annotations

import json

from tests.engine.ep_process import PROMPT, engine


def test_kimi_generate_ep2_matches_ep1():
    args = ["generate", "--model", "tiny-kimi", "--prompt-ids", PROMPT, "--max-tokens", "20", "--ignore-eos",
            "--json", "--threads", "1", "--dtype", "float32"]
    results = {}
    for ep in ("1", "2"):
        done = engine(*args, "--ep", ep)
        assert done.returncode == 0, done.stderr[-3000:]
        results[ep] = json.loads(done.stdout)["tokens"]
    assert len(results["1"]) == 20
    assert results["2"] == results["1"]


def test_kimi_serving_ep2_matches_ep1_with_whole_and_chunked_prompts(tmp_path):
    """A served run under each rule: the same tokens and end states at EP 1 and EP 2."""
    import sqlite3

    from tests.engine.ep_process import tokens_by_request

    for chunked in ("0", "1"):
        dbs = {}
        for ep in ("1", "2"):
            run_dir = tmp_path / f"ep{ep}-{chunked}"
            done = engine("serve", "--model", "tiny-kimi", "--run-dir", str(run_dir), "--requests", "8", "--rate",
                          "100000", "--seed", "3", "--kv-blocks", "40", "--dtype", "float32", "--ep", ep,
                          CHUNKSCOPE_MAX_PREFILL_TOKENS="32", CHUNKSCOPE_MLA_CHUNKED_PREFILL=chunked)
            assert done.returncode == 0, done.stderr[-3000:]
            dbs[ep] = run_dir / "telemetry.db"
        assert tokens_by_request(dbs["2"]) == tokens_by_request(dbs["1"])
        conn = sqlite3.connect(f"file:{dbs['2']}?mode=ro", uri=True)
        split = conn.execute("SELECT count(*) FROM chunks WHERE is_last = 0").fetchone()[0]
        assert (split > 0) == (chunked == "1")  # whole prompts under the rule, chunks with the lever on
