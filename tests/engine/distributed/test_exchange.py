"""The MoE exchanges between expert-parallel ranks, on their own: 3 gloo ranks, random routings of
uneven sizes (fewer tokens than ranks included), both exchanges equal to one rank's sum bit for bit;
the token slices and the start handshake's field-by-field message."""
from __future__ import annotations

import json
import os
import socket

import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st

from engine.distributed import handshake
from engine.distributed.exchange import EXCHANGES, make_exchange, token_slices
from engine.distributed.group import init_group, shutdown
from engine.model.qwen3_5_moe import sum_rows

NUM_EXPERTS, HIDDEN, WORLD = 8, 6, 3
CASES = ((0, 7, 2), (1, 1, 2), (2, 33, 3), (3, 2, 1), (4, 16, 8))   # (seed, tokens, experts per token)


def routing(seed: int, num_tokens: int, top_k: int, size: int):
    """(tokens [N] of the assignments sorted by expert, their rows [N, H], each rank's run [lo, hi))."""
    generator = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:top_k] for _ in range(num_tokens)])
    flat = experts.reshape(-1)                                              # [T * k]
    order = torch.argsort(flat, stable=True)
    tokens = torch.arange(num_tokens).repeat_interleave(top_k)[order]       # [N], expert order
    # Magnitudes spread over 10^-3 .. 10^3: a different summation order would change the bits.
    rows = torch.randn(len(order), HIDDEN, generator=generator) * 10.0 ** torch.randint(-3, 4, (len(order), 1),
                                                                                         generator=generator)
    bounds = [round(r * NUM_EXPERTS / size) for r in range(size + 1)]     # rank r's experts
    sorted_experts = flat[order]
    runs = [(int((sorted_experts < lo).sum()), int((sorted_experts < hi).sum())) for lo, hi in zip(bounds, bounds[1:])]
    return tokens, rows, runs


def _rank(rank: int, size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = init_group(rank, size, timeout_s=60, device=torch.device("cpu"), start_timeout_s=120)
    results = []
    try:
        for kind in EXCHANGES:
            exchange = make_exchange(kind, group)
            for seed, num_tokens, top_k in CASES:
                tokens, rows, runs = routing(seed, num_tokens, top_k, size)
                lo, hi = runs[rank]
                got = exchange.combine(rows[lo:hi], tokens, runs, num_tokens)     # [T, H]
                results.append([kind, seed, bool(torch.equal(got, sum_rows(tokens, rows, num_tokens)))])
    finally:
        shutdown()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def test_both_exchanges_equal_one_ranks_sum_bit_for_bit_on_every_rank(tmp_path):
    # The cases reach the edges: a rank with no assignment, and fewer tokens than ranks.
    assert any(lo == hi for seed, tokens, k in CASES for lo, hi in routing(seed, tokens, k, WORLD)[2])
    assert any(tokens < WORLD for _, tokens, _ in CASES)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(WORLD, port, str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == len(EXCHANGES) * len(CASES)
        assert all(equal for _, _, equal in results), [r for r in results if not r[2]]


@given(num_tokens=st.integers(0, 500), size=st.integers(1, 16))
def test_token_slices_tile_the_tokens_evenly(num_tokens, size):
    slices = token_slices(num_tokens, size)
    assert len(slices) == size and slices[0][0] == 0 and slices[-1][1] == num_tokens
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    lengths = [hi - lo for lo, hi in slices]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


def test_the_handshake_names_each_differing_field_with_every_ranks_value():
    settings = {"dtype": "float32", "hidden_size": 64, "ep": 2, "kv_blocks": 128, "ssm_slots": 8, "block_size": 16,
                "exchange": "all_to_all"}
    zero = handshake.encode("abc123" * 8, settings).tolist()
    assert len(zero) == len(handshake.FIELDS) and handshake.disagreements([zero, zero]) == []
    one = handshake.encode("fff000" * 8, {**settings, "dtype": "bfloat16", "kv_blocks": 64}).tolist()
    assert handshake.disagreements([zero, one]) == [
        "dtype: rank 0 float32, rank 1 bfloat16", "--kv-blocks: rank 0 128, rank 1 64",
        "checkpoint hash: rank 0 abc123abc123abc..., rank 1 fff000fff000fff..."]
    odd = handshake.encode("", {**settings, "dtype": "int8", "exchange": "ring"}).tolist()
    shown = handshake.disagreements([zero, odd])
    assert "dtype: rank 0 float32, rank 1 unknown (0)" in shown and "--ep-exchange: rank 0 all_to_all, rank 1 unknown (0)" in shown
