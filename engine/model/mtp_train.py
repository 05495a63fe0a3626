"""Self-distillation of an MTP module on its own model's greedy continuations (how ``tiny`` gets one).

The main model is frozen. Seeded prompts of printable bytes are continued greedily by the
main model (batched decode through a ModelRunner); one forward over each whole sequence gives
the main model's normed hidden state h_p and its next-token distribution at every position.
The MTP row at p sees (t_{p+1}, h_p) and is trained towards the main model's distribution at
p + 1 (the token after t_{p+1}) with a KL loss: soft targets teach the whole distribution, so
sampled requests accept drafts too, not only greedy ones.

Deterministic for a seed on one machine (CPU float32); the checkpoint hash covers the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache.kv_store import KVStore
from engine.model.batch import build_batch
from engine.model.mtp import MTPModule
from engine.model.runner import ModelRunner
from engine.cache.sequence import SequenceState


@dataclass(frozen=True)
class DistillSettings:
    num_sequences: int = 64
    prompt_len: int = 16
    continuation_len: int = 96
    epochs: int = 10
    learning_rate: float = 3e-3
    seed: int = 0
    repeat_every: int = 2       # every n-th prompt is a short random unit repeated (0 = none)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DistillData:
    tokens: torch.Tensor    # [N, T] long: prompt + greedy continuation
    hidden: torch.Tensor    # [N, T, H] the main model's normed hidden states
    logits: torch.Tensor    # [N, T, V] the main model's next-token logits


def greedy_sequences(model, settings: DistillSettings) -> torch.Tensor:
    """[N, prompt_len + continuation_len] tokens: seeded prompts, greedy continuations.

    Prompts are random printable bytes; with ``repeat_every`` = n, every n-th one is a random
    unit of 2..8 bytes (any byte) repeated, the looping text speculation meets most.
    """
    generator = torch.Generator().manual_seed(settings.seed)
    prompts = torch.randint(32, 127, (settings.num_sequences, settings.prompt_len), generator=generator)
    for row in range(0, settings.num_sequences, settings.repeat_every or settings.num_sequences + 1):
        period = int(torch.randint(2, 9, (1,), generator=generator))
        unit = torch.randint(0, 256, (period,), generator=generator)
        prompts[row] = unit.repeat(-(-settings.prompt_len // period))[:settings.prompt_len]
    total = settings.prompt_len + settings.continuation_len
    block = 16
    runner = ModelRunner.build(model, num_kv_blocks=settings.num_sequences * (-(-total // block)),
                               num_ssm_slots=settings.num_sequences, block_size=block)
    seqs = [SequenceState(request_id=i) for i in range(settings.num_sequences)]
    last = []
    for seq, prompt in zip(seqs, prompts.tolist()):
        runner.pools.admit(seq)
        last.append(int(runner.prefill_chunk(seq, prompt, 0, len(prompt), True).argmax()))
    columns = [torch.tensor(last)]
    for _ in range(settings.continuation_len - 1):
        last = runner.decode(seqs, last).argmax(-1).tolist()
        columns.append(torch.tensor(last))
    return torch.cat([prompts, torch.stack(columns, dim=1)], dim=1)


@torch.inference_mode()
def main_model_targets(model, tokens: torch.Tensor) -> DistillData:
    """One whole-sequence forward per row of ``tokens``: hidden states and logits at every position."""
    length = tokens.shape[1]
    block = 16
    num_blocks = -(-length // block)
    runner = ModelRunner.build(model, num_kv_blocks=num_blocks, num_ssm_slots=1, block_size=block)
    hiddens, logits = [], []
    for row in tokens.tolist():
        seq = SequenceState(request_id=0)
        runner.pools.admit(seq)
        runner.pools.blocks.allocate(seq, length)
        batch = build_batch((row, 0, seq.block_table, seq.ssm_slot), [], block, "cpu")
        out, hidden = model(batch, runner.pools.kv_store, runner.pools.ssm, return_hidden=True)
        hiddens.append(hidden)
        logits.append(out)
        runner.pools.release(seq)
    return DistillData(tokens, torch.stack(hiddens), torch.stack(logits))


def distill(model, mtp: MTPModule, settings: DistillSettings) -> list[float]:
    """Train ``mtp`` (attached to ``model``) in place; returns the mean KL loss of each epoch.

    Gradients are switched on here: the checkpoint may be built inside a caller that turned
    them off (``python -m engine generate`` does).
    """
    with torch.inference_mode(False), torch.enable_grad():
        return _distill(model, mtp, settings)


def _distill(model, mtp: MTPModule, settings: DistillSettings) -> list[float]:
    data = main_model_targets(model, greedy_sequences(model, settings))
    num_seqs, length = data.tokens.shape
    block = 16
    layer_ids = mtp.kv_layer_ids
    config = model.config
    kv = KVStore(layer_ids, -(-length // block), block, config.num_key_value_heads, config.head_dim)
    table = list(range(kv.num_blocks))
    with torch.no_grad():
        embeds = model.model.embed_tokens(data.tokens)  # [N, T, H] (frozen, shared)
    lm_head = model.lm_head.weight.detach()
    optimizer = torch.optim.Adam(mtp.parameters(), lr=settings.learning_rate)
    order = torch.Generator().manual_seed(settings.seed + 1)
    losses = []
    mtp.train()
    for _ in range(settings.epochs):
        total = 0.0
        for index in torch.randperm(num_seqs, generator=order).tolist():
            # Rows p = 0 .. T-2: (t_{p+1}, h_p) -> the main model's distribution at p + 1.
            batch = build_batch((data.tokens[index, 1:].tolist(), 0, table, 0), [], block, "cpu")
            g = mtp(embeds[index, 1:], data.hidden[index, :-1], batch, kv, model.rotary)  # [T-1, H]
            log_q = F.log_softmax(F.linear(g, lm_head).float(), dim=-1)
            log_p = F.log_softmax(data.logits[index, 1:], dim=-1)
            loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for store in (kv.keys, kv.values):  # the graph held views of them; start clean
                for layer in layer_ids:
                    store[layer] = store[layer].detach()
            total += float(loss.detach())
        losses.append(total / num_seqs)
    mtp.eval()
    return losses


@torch.inference_mode()
def greedy_acceptance(model, sequences: list[list[int]], first_rows: list[int] | None = None) -> float:
    """How often the MTP head's greedy draft equals the main model's greedy token, over ``sequences``.

    Row p drafts t_{p+2} from (t_{p+1}, h_p); compared with the main model's argmax at p + 1.
    ``first_rows[i]``: count rows from there on only (prompt length - 1 = the rows that draft the
    greedy continuation itself: their drafts are what a speculative decode would verify).
    """
    block = 16
    config = model.config
    hits = total = 0
    for index, sequence in enumerate(sequences):
        first = first_rows[index] if first_rows is not None else 0
        data = main_model_targets(model, torch.tensor([sequence]))
        kv = KVStore(model.mtp.kv_layer_ids, -(-len(sequence) // block), block, config.num_key_value_heads,
                     config.head_dim)
        batch = build_batch((sequence[1:], 0, list(range(kv.num_blocks)), 0), [], block, "cpu")
        g = model.mtp(model.model.embed_tokens(batch.token_ids), data.hidden[0, :-1], batch, kv, model.rotary)
        drafts = model.lm_head(g).argmax(-1)[first:]  # [T-1-first]
        hits += int((drafts == data.logits[0, 1 + first:].argmax(-1)).sum())
        total += drafts.numel()
    return hits / total
