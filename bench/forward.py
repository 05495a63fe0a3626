"""Forward speed: Chunkscope's runner vs transformers' Qwen3_5ForCausalLM on the same weights.

Prints, for the ``tiny`` default and a SmolLM-sized random Qwen3.5 (hidden 576, 30 layers,
3:1 linear/full), prefill tok/s on a 512-token prompt and decode tok/s at batch 1, 8 and 32,
the ratios to transformers, the fp32 GEMM FLOP/s measured here, and the share of that
GEMM bound the decode reaches (2 * parameters FLOPs per token).

    python bench/forward.py [--models tiny,smol] [--steps 8] [--dtype float32|bfloat16] [--no-hf]
"""
from __future__ import annotations

import argparse
import time

import torch

from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.runner import ModelRunner
from engine.model.tiny import random_init
from engine.sequence import SequenceState

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                   linear_value_head_dim=64, tie_word_embeddings=True)
PROMPT_LEN, DECODE_CONTEXT = 512, 64


def gemm_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def build(name: str, dtype: torch.dtype) -> Qwen35ForCausalLM:
    if name == "tiny":
        return load_model("tiny", dtype=dtype)[0]
    model = Qwen35ForCausalLM(SMOL)
    random_init(model, seed=0)
    model.to(dtype).eval()
    model.fuse()
    return model


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def ours_prefill(model, prompt) -> float:
    def run():
        runner = ModelRunner(model, num_kv_blocks=40, num_ssm_slots=1, dtype=next(model.parameters()).dtype)
        seq = SequenceState(0)
        runner.admit(seq)
        runner.prefill_chunk(seq, prompt, 0, len(prompt), True)
    return len(prompt) / timed(run, 2)


def ours_decode(model, batch: int, steps: int) -> float:
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, num_kv_blocks=batch * 8 + 8, num_ssm_slots=batch, dtype=dtype)
    seqs = []
    for i in range(batch):
        seq = SequenceState(i)
        runner.admit(seq)
        runner.prefill_chunk(seq, list(range(1, DECODE_CONTEXT + 1)), 0, DECODE_CONTEXT, True)
        seqs.append(seq)
    tokens = [1] * batch
    return batch / timed(lambda: runner.decode(seqs, tokens), steps)


def hf_model_for(model: Qwen35ForCausalLM):
    import transformers
    cfg = model.config.to_hf_dict()
    for key in ("model_type", "architectures", "dtype"):
        cfg.pop(key)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg)).eval()
    state = {k: v.float() for k, v in model.state_dict().items()}
    hf.load_state_dict(state, strict=False)
    return hf.to(next(model.parameters()).dtype)


@torch.inference_mode()
def hf_prefill(hf, prompt) -> float:
    ids = torch.tensor([prompt])
    return len(prompt) / timed(lambda: hf(ids, use_cache=True), 1)


@torch.inference_mode()
def hf_decode(hf, batch: int, steps: int) -> float:
    ids = torch.arange(1, DECODE_CONTEXT + 1).repeat(batch, 1)
    out = hf(ids, use_cache=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    token = torch.ones(batch, 1, dtype=torch.long)
    position = [DECODE_CONTEXT]

    def step():
        hf(token, cache=cache, use_cache=True,
           position_ids=torch.full((batch, 1), position[0], dtype=torch.long))
        position[0] += 1
    return batch / timed(step, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smol")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    flops = gemm_flops(dtype)
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} measured GEMM: {flops / 1e9:.1f} GFLOP/s")
    for name in args.models.split(","):
        model = build(name, dtype)
        # Weights touched by GEMMs per token: everything but the embedding table, plus the LM head
        # (named_parameters lists a tied head once, under embed_tokens).
        params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
        if model.config.tie_word_embeddings:
            params += model.lm_head.weight.numel()
        prompt = [(i * 37) % model.config.vocab_size for i in range(PROMPT_LEN)]
        hf = None if args.no_hf else hf_model_for(model)
        ours = ours_prefill(model, prompt)
        theirs = hf_prefill(hf, prompt) if hf is not None else float("nan")
        print(f"[{name}] params(no embed)={params / 1e6:.1f}M  prefill {PROMPT_LEN}: ours {ours:9.0f} tok/s  "
              f"transformers {theirs:9.0f} tok/s  ratio {ours / theirs:6.1f}x")
        for batch in (1, 8, 32):
            ours = ours_decode(model, batch, args.steps)
            theirs = hf_decode(hf, batch, max(2, args.steps // 4)) if hf is not None else float("nan")
            share = ours * 2 * params / flops
            print(f"[{name}] decode b{batch:<2}: ours {ours:9.0f} tok/s ({batch / ours * 1e3:6.2f} ms/step)  "
                  f"transformers {theirs:8.0f} tok/s  ratio {ours / theirs:6.1f}x  GEMM-bound share {share:5.1%}")


if __name__ == "__main__":
    main()
