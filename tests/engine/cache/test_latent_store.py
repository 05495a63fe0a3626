"""The paged latent cache: bounded token gathers, shared prefix blocks, byte accounting in latent blocks."""
from __future__ import annotations

import pytest
import torch

from engine.cache.latent_store import LatentKVStore, build_latent_cache, latent_block_bytes
from engine.cache.sequence import SequenceState
from engine.model.loader import load_model
from engine.model.runner import ModelRunner


def test_gather_tokens_reads_only_the_blocks_of_the_range():
    store = LatentKVStore([3], num_blocks=6, block_size=4, latent_dim=2)
    table = torch.tensor([5, 0, 2, 1])  # positions 0-3 in block 5, 4-7 in block 0, ...
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(16)])
    rows = torch.arange(16, dtype=torch.float32)[:, None].repeat(1, 2)  # row p holds p
    store.write(3, slots, rows)
    for start, end in ((0, 16), (3, 9), (4, 8), (13, 14), (0, 1)):
        got = store.gather_tokens(3, table, start, end)
        assert got[:, 0].tolist() == list(range(start, end))
    assert store.gather(3, table[None, :2]).shape == (1, 8, 2)


def test_block_bytes_and_budget_count_latent_rows():
    assert latent_block_bytes(2, 16, 80, torch.float32) == 2 * 16 * 80 * 4
    manager, store = build_latent_cache([1, 3], 0, 16, 80, torch.float32, "cpu", budget_bytes=10 * 2 * 16 * 80 * 4 + 5)
    assert manager.num_blocks == 10 and store.num_bytes == 10 * store.block_bytes
    with pytest.raises(ValueError, match="hold no latent KV block"):
        build_latent_cache([1], 0, 16, 80, torch.bfloat16, "cpu", budget_bytes=100)


@pytest.fixture(scope="module")
def tiny_kimi():
    model, config, _ = load_model("tiny-kimi")
    return model, config


def test_a_megabyte_holds_the_latent_share_of_tokens(tiny_kimi):
    """--kv-cache-mb buys full_kv_width / latent_dim times the blocks per-head K/V would take."""
    model, config = tiny_kimi
    runner = ModelRunner.build(model, num_kv_blocks=1, num_ssm_slots=1, kv_budget_bytes=1 << 20)
    per_head_block = len(config.full_attention_layers) * 16 * config.full_kv_width * 4
    assert runner.pools.blocks.num_blocks == (1 << 20) // runner.pools.fp_block_bytes
    assert runner.pools.blocks.num_blocks >= 4 * ((1 << 20) // per_head_block)
    assert runner.pools.kv_bytes_total == runner.pools.blocks.num_blocks * runner.pools.fp_block_bytes
    with pytest.raises(ValueError, match="MLA model caches latents"):
        from engine.cache.kv_quant import InnerQConfig
        ModelRunner.build(model, num_kv_blocks=4, num_ssm_slots=1, kv_quant=InnerQConfig(bits=8))


def test_shared_prefix_blocks_give_the_logits_of_a_full_prefill(tiny_kimi):
    """A second sequence reuses the first's latent blocks (prefix cache style: shared block ids, the
    SSM state restored at the block boundary) and prefills only its tail over them."""
    model, _ = tiny_kimi
    prompt = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = ModelRunner.build(model, num_kv_blocks=16, num_ssm_slots=3)
    first = SequenceState(0)
    runner.pools.admit(first)
    runner.prefill_chunk(first, prompt, 0, 32, False)
    snapshot = runner.pools.ssm.snapshot(first.ssm_slot)
    full = runner.prefill_chunk(first, prompt, 32, 13, True)
    second = SequenceState(1)
    runner.pools.admit(second)
    runner.pools.blocks.share(second, first.block_table[:2])
    second.num_cached_tokens = 32
    runner.pools.ssm.restore(snapshot, second.ssm_slot)
    reused = runner.prefill_chunk(second, prompt, 32, 13, True)
    torch.testing.assert_close(reused, full, rtol=1e-5, atol=1e-5)
    assert runner.pools.blocks.ref_count(first.block_table[0]) == 2
    runner.pools.release(first)
    runner.pools.release(second)
    runner.pools.blocks.check_invariants()
    assert runner.pools.blocks.num_used == 0
