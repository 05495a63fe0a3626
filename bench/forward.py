"""Forward speed: Chunkscope's runner vs transformers' Qwen3_5ForCausalLM on the same weights.

Prints, for the ``tiny`` default and a SmolLM-sized random Qwen3.5 (hidden 576, 30 layers,
3:1 linear/full), prefill tok/s on a 512-token prompt and decode tok/s at batch 1, 8 and 32,
the ratios to transformers, the GEMM FLOP/s measured here, and the share of that GEMM bound
each side reaches (decode: 2 * parameters FLOPs per token; prefill: the body per token plus
one LM-head row, as only the last row's logits are computed). ``ceiling`` is the ratio an
engine doing nothing but its GEMMs at the measured GEMM rate would reach against the same
transformers time: no implementation on this machine can beat it by much.

The machine is shared, so every measurement is interleaved: each round times ours, then
transformers, then a reference GEMM, back to back, and the table reports per-round medians.
Load then hits both sides alike and the ratios stay meaningful even when wall times do not.

    python bench/forward.py [--models tiny,smol] [--rounds 3] [--steps 4] [--threads 1]
                            [--dtype float32|bfloat16] [--no-hf] [--clock wall|cpu] [--no-prepack]
"""
from __future__ import annotations

import argparse
import statistics
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
PROMPT_LEN, DECODE_CONTEXT, BATCHES = 512, 32, (1, 8, 32)


def gemm_seconds(dtype: torch.dtype, size: int = 1024) -> float:
    """Seconds for one [size, size] @ [size, size] GEMM (2 * size^3 FLOPs)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    return seconds(lambda: a @ b)


def build(name: str, dtype: torch.dtype) -> Qwen35ForCausalLM:
    if name == "tiny":
        return load_model("tiny", dtype=dtype)[0]
    model = Qwen35ForCausalLM(SMOL)
    random_init(model, seed=0)
    model.to(dtype).eval()
    model.fuse()
    return model


# perf_counter (wall) or thread_time (CPU seconds of this thread: with --threads 1 all the work runs
# here, and time spent descheduled on a shared machine is not counted against either side).
CLOCK = time.perf_counter


def seconds(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


class Ours:
    """Our runner: a prefill on a fresh runner, and decode over sequences prefilled once."""

    def __init__(self, model: Qwen35ForCausalLM, max_steps: int):
        self.model = model
        self.dtype = next(model.parameters()).dtype
        blocks_per_seq = -(-(DECODE_CONTEXT + max_steps) // 16) + 1
        self.runner = ModelRunner(model, num_kv_blocks=max(BATCHES) * blocks_per_seq, num_ssm_slots=max(BATCHES),
                                  dtype=self.dtype)
        self.seqs = []
        for i in range(max(BATCHES)):
            seq = SequenceState(i)
            self.runner.admit(seq)
            self.runner.prefill_chunk(seq, list(range(1, DECODE_CONTEXT + 1)), 0, DECODE_CONTEXT, True)
            self.seqs.append(seq)

    def prefill(self, prompt: list[int]) -> float:
        runner = ModelRunner(self.model, num_kv_blocks=-(-len(prompt) // 16) + 1, num_ssm_slots=1, dtype=self.dtype)
        seq = SequenceState(0)
        runner.admit(seq)
        return seconds(lambda: runner.prefill_chunk(seq, prompt, 0, len(prompt), True))

    def decode_step(self, batch: int) -> float:
        return seconds(lambda: self.runner.decode(self.seqs[:batch], [1] * batch))


class Theirs:
    """transformers' Qwen3_5ForCausalLM with the same weights; one growing cache per batch size."""

    def __init__(self, model: Qwen35ForCausalLM):
        import transformers
        cfg = model.config.to_hf_dict()
        for key in ("model_type", "architectures", "dtype"):
            cfg.pop(key)
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg)).eval()
        hf.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
        self.hf = hf.to(next(model.parameters()).dtype)
        self.caches, self.positions = {}, {}
        with torch.inference_mode():
            for batch in BATCHES:
                out = self.hf(torch.arange(1, DECODE_CONTEXT + 1).repeat(batch, 1), use_cache=True)
                self.caches[batch] = out.past_key_values
                self.positions[batch] = DECODE_CONTEXT

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        return seconds(lambda: self.hf(ids, use_cache=True))

    @torch.inference_mode()
    def decode_step(self, batch: int) -> float:
        position = torch.full((batch, 1), self.positions[batch], dtype=torch.long)
        token = torch.ones(batch, 1, dtype=torch.long)
        self.positions[batch] += 1
        return seconds(lambda: self.hf(token, cache=self.caches[batch], use_cache=True, position_ids=position))


def gemm_params(model: Qwen35ForCausalLM) -> int:
    """Weights touched by GEMMs per token: all but the embedding table, plus the LM head (once, even if tied)."""
    params = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    if model.config.tie_word_embeddings:
        params += model.lm_head.weight.numel()
    return params


def bench_model(name: str, dtype: torch.dtype, rounds: int, steps: int, with_hf: bool) -> None:
    model = build(name, dtype)
    params = gemm_params(model)
    # A prefill runs the LM head on its last row only, so its GEMM work is the body per token plus one head.
    head = model.lm_head.weight.numel()
    prefill_flops = 2 * ((params - head) * PROMPT_LEN + head)
    prompt = [(i * 37) % model.config.vocab_size for i in range(PROMPT_LEN)]
    ours, theirs = Ours(model, (rounds + 1) * steps), (Theirs(model) if with_hf else None)
    # Warm-up: first calls allocate and pick kernels.
    ours.decode_step(1)
    if theirs:
        theirs.decode_step(1)
    times: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        times.setdefault(key, []).append(value)

    for _ in range(rounds):
        record("gemm", gemm_seconds(dtype))
        record("ours prefill", ours.prefill(prompt))
        if theirs:
            record("theirs prefill", theirs.prefill(prompt))
        for batch in BATCHES:
            for _ in range(steps):  # alternate step by step so a load spike hits both sides
                record(f"ours b{batch}", ours.decode_step(batch))
                if theirs:
                    record(f"theirs b{batch}", theirs.decode_step(batch))
    median = {key: statistics.median(values) for key, values in times.items()}
    flops = 2 * 1024 ** 3 / median["gemm"]
    nan = float("nan")
    ours_rate = PROMPT_LEN / median["ours prefill"]
    theirs_rate = PROMPT_LEN / median["theirs prefill"] if theirs else nan
    print(f"[{name}] params(no embed)={params / 1e6:.1f}M  GEMM {flops / 1e9:.1f} GFLOP/s  "
          f"prefill {PROMPT_LEN}: ours {ours_rate:8.1f} tok/s  transformers {theirs_rate:8.1f} tok/s  "
          f"ratio {ours_rate / theirs_rate:5.2f}x  GEMM-bound share {prefill_flops / median['ours prefill'] / flops:5.1%}  "
          f"ceiling {PROMPT_LEN / theirs_rate / (prefill_flops / flops):5.2f}x")
    for batch in BATCHES:
        ours_rate = batch / median[f"ours b{batch}"]
        theirs_rate = batch / median[f"theirs b{batch}"] if theirs else nan
        print(f"[{name}] decode b{batch:<2}: ours {ours_rate:8.1f} tok/s ({median[f'ours b{batch}'] * 1e3:7.2f} ms/step)  "
              f"transformers {theirs_rate:8.1f} tok/s  ratio {ours_rate / theirs_rate:5.2f}x  "
              f"GEMM-bound share {ours_rate * 2 * params / flops:5.1%}  "
              f"ceiling {flops / (2 * params * theirs_rate):5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smol")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per batch size per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: thread CPU time (steadier on a loaded machine; meaningful with --threads 1)")
    parser.add_argument("--no-prepack", action="store_true",
                        help="MKL sgemm only: no oneDNN-prepacked prefill GEMMs (the engine prepacks by default; "
                             "CHUNKSCOPE_ONEDNN_PREPACK=0 does the same)")
    args = parser.parse_args()
    if args.no_prepack:
        from engine.model import layers
        layers.PREPACK_ENABLED = False
    for name, value in (("--rounds", args.rounds), ("--steps", args.steps), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} rounds={args.rounds} steps={args.steps} clock={args.clock}")
    for name in args.models.split(","):
        if name not in ("tiny", "smol"):
            parser.error(f"--models: unknown model {name!r} (tiny, smol)")
        bench_model(name, getattr(torch, args.dtype), args.rounds, args.steps, not args.no_hf)


if __name__ == "__main__":
    main()
