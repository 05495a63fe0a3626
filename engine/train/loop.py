"""Training ``tiny-chat``: the tiny Qwen3.5 configuration and its MTP head, from a seed, on CPU
(``tiny-chat-moe``: tiny-moe's configuration, the same way).

The forward is the serving model's own layers (the same modules, caches and packed batch a
prefill uses), with the Gated DeltaNet recurrence swapped for its autograd form; one packed
sequence per step. The main model learns the next token of each reply token; the MTP head, on
the main model's (detached) hidden states, the token after that, as it drafts when serving.
Deterministic for a seed and a thread count on one machine (float32 throughout).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.cache.kv_store import KVStore
from engine.cache.ssm_pool import SSMPool
from engine.model.batch import build_batch
from engine.model.mtp import attach_mtp
from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.qwen3_5_moe import Qwen35MoeForCausalLM
from engine.model.tiny import TINY_CONFIG, random_init
from engine.model.tiny_moe import TINY_MOE_CONFIG
from engine.train.corpus import ChatCorpus
from engine.train.delta_rule import differentiable_gated_delta_rule

BLOCK = 16


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 32
    steps: int = 3000
    max_len: int = 1280          # tokens per packed sequence (one sequence per step)
    learning_rate: float = 3e-3
    warmup: int = 60
    final_lr_ratio: float = 0.1  # cosine decay to this share of the peak
    mtp_weight: float = 0.5
    clip: float = 1.0
    # 1 thread: on the shared 2-core machine 2 threads ran ~10x slower per step under load (OpenMP
    # threads spin against the other jobs), measured with the same sequences.
    threads: int = 1
    family: str = "dense"        # "dense": tiny-chat (the tiny configuration); "moe": tiny-chat-moe (tiny-moe's)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepLoss:
    main: float   # mean cross-entropy of the main model's next-token predictions on reply tokens
    mtp: float    # the MTP head's, one token further


# family -> (configuration, model class); tiny-moe's configuration gains the MTP head tiny's has.
FAMILIES = {"dense": (TINY_CONFIG, Qwen35ForCausalLM),
            "moe": (replace(TINY_MOE_CONFIG, mtp_num_hidden_layers=1), Qwen35MoeForCausalLM)}


def build_model(seed: int, family: str = "dense") -> Qwen35ForCausalLM:
    """The family's tiny configuration with an MTP head, seeded as ``tiny`` is, ready for training."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    config, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config)
    random_init(model, seed)
    random_init(attach_mtp(model), seed + 1)
    for layer in model.model.layers:
        if layer.is_linear:
            layer.linear_attn.prefill_rule = differentiable_gated_delta_rule
    return model


def sequence_losses(model: Qwen35ForCausalLM, tokens: list[int], targets: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main loss, MTP loss) of one packed sequence, through the serving layers with autograd."""
    config, length = model.config, len(tokens)
    num_blocks = -(-length // BLOCK)
    kv = KVStore(model.kv_layer_ids, num_blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    gdn = next(layer.linear_attn for layer in model.model.layers if layer.is_linear)
    pool = SSMPool(1, len(config.linear_attention_layers), gdn.conv_dim, gdn.conv_kernel, gdn.num_v_heads,
                   gdn.head_k_dim, gdn.head_v_dim)
    table = list(range(num_blocks))
    batch = build_batch((tokens, 0, table, 0), [], BLOCK, "cpu")
    x = model.model.embed_tokens(batch.token_ids)  # [T, H]
    cos, sin = model.rotary.cos_sin(batch.positions, x.dtype)
    for layer in model.model.layers:
        x = layer(x, batch, kv, pool, model.rotary, cos, sin)
    hidden = model.model.norm(x)  # [T, H]
    ids = batch.token_ids
    mask = torch.tensor(targets)
    main = _masked_ce(model.lm_head(hidden[:-1]), ids[1:], mask[1:])
    # MTP rows p = 0 .. T-2 see (t_{p+1}, h_p); rows up to T-3 have a token at p + 2 to learn.
    mtp_batch = build_batch((tokens[1:], 0, table, 0), [], BLOCK, "cpu")
    g = model.mtp(model.model.embed_tokens(mtp_batch.token_ids), hidden[:-1].detach(), mtp_batch, kv,
                  model.rotary)  # [T-1, H]
    mtp = _masked_ce(model.lm_head(g[:-1]), ids[2:], mask[2:])
    return main, mtp


def _masked_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = F.cross_entropy(logits.float(), labels, reduction="none")  # [R]
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def learning_rate(settings: TrainSettings, step: int) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_ratio`` of the peak at the last step."""
    if step < settings.warmup:
        return settings.learning_rate * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    ratio = settings.final_lr_ratio + (1 - settings.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return settings.learning_rate * ratio


def train(settings: TrainSettings, *, steps: int | None = None,
          progress: bool = True) -> tuple[Qwen35ForCausalLM, list[StepLoss]]:
    """Train from the seed; ``steps`` stops early (the schedule stays the full run's)."""
    torch.set_num_threads(settings.threads)
    model = build_model(settings.seed, settings.family)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    corpus = iter(ChatCorpus(settings.seed, settings.max_len))
    losses: list[StepLoss] = []
    total = settings.steps if steps is None else min(steps, settings.steps)
    bar = tqdm(range(total), desc="train tiny-chat", unit="step", disable=not progress)
    with torch.inference_mode(False), torch.enable_grad():
        for step in bar:
            sequence = next(corpus)
            main, mtp = sequence_losses(model, sequence.tokens, sequence.targets)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(settings, step)
            optimizer.zero_grad()
            (main + settings.mtp_weight * mtp).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clip)
            optimizer.step()
            losses.append(StepLoss(float(main.detach()), float(mtp.detach())))
            bar.set_postfix(loss=f"{losses[-1].main:.3f}", mtp=f"{losses[-1].mtp:.3f}")
    model.eval()
    return model, losses
