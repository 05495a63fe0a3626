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
