"""InnerQ KV quantization vs full precision: capacity, greedy agreement, logit KL, decode speed.

For each config and each dtype (innerq8, innerq4), all from one run:

* ``capacity_ratio``: KV blocks (tokens) the same byte budget holds, quantized / full precision
  (sink and recent windows aside: they are full-precision blocks in both);
* ``greedy_agreement``: over 64 greedy steps after the prompt, the share of steps whose
  argmax equals full precision's token, teacher-forced (both read the same history, so one
  early flip does not count for every later step);
* ``logit_kl``: mean KL(full precision || quantized) of the next-token distributions over
  those 65 positions (the prompt's last one included);
* ``decode_ms_ratio``: median decode ms/step quantized / full precision (same sequence, same
  steps, timed in alternation).

The calibration runs first, as in the engine: a separate calibration prompt is prefilled
in chunks with the calibration poll before each chunk (``poll_innerq``), then polled to
``applied``; the evaluation prompt is then written with the key scales in use, so its
blocks are quantized as they leave the sink and recent windows.

Configs: the parity tests' tiny shapes with every parameter perturbed (``parity-base``,
``parity-pattern``, 512-token context) and a SmolLM-size layer set (hidden 576, 9 heads, 3 KV
heads, head dim 64, one 3:1 linear/full layer set) at a 2,048-token context.

    python bench/kv_quant.py [--json] [--configs parity-base,parity-pattern,smol-2k] [--steps 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import dataclasses
import json
import statistics
import time

# The repository root first: bench/telemetry.py must not shadow the telemetry package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.cache.kv_quant import config_for  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.qwen3_5 import Qwen35ForCausalLM  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.model.tiny import perturb_parameters, random_init  # noqa: E402
from engine.cache.sequence import SequenceState  # noqa: E402
from engine.model.cpu_features import cpu_model  # noqa: E402

PARITY_BASE = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
PARITY_PATTERN = dataclasses.replace(
    PARITY_BASE, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"))
SMOL_LAYER_SET = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                             num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_num_key_heads=4,
                             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                             tie_word_embeddings=True)
# name -> (config, context tokens, calibration tokens, init)
CONFIGS = {
    "parity-base": (PARITY_BASE, 512, 256, "perturb"),
    "parity-pattern": (PARITY_PATTERN, 512, 256, "perturb"),
    "smol-2k": (SMOL_LAYER_SET, 2048, 512, "random"),
}
DTYPES = ("innerq8", "innerq4")
CHUNK = 256


def build(config: ModelConfig, init: str, seed: int = 0) -> Qwen35ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen35ForCausalLM(config)
    perturb_parameters(model, torch.Generator().manual_seed(seed)) if init == "perturb" else random_init(model, seed)
    model.eval()
    model.fuse()
    return model


def prefill(runner: ModelRunner, seq: SequenceState, prompt: list[int]) -> torch.Tensor:
    """Chunked prefill with the calibration poll before each chunk, as the scheduler does; last logits [V]."""
    logits = None
    for offset in range(0, len(prompt), CHUNK):
        runner.pools.poll_kv_quant()
        length = min(CHUNK, len(prompt) - offset)
        logits = runner.prefill_chunk(seq, prompt, offset, length, offset + length == len(prompt))
    return logits


class Side:
    """One runner (full precision or a quantized dtype) with its calibrated evaluation sequence."""

    def __init__(self, model, dtype: str, budget: int, calib_prompt: list[int], calib_tokens: int):
        self.runner = ModelRunner.build(model, num_kv_blocks=1, num_ssm_slots=2, kv_budget_bytes=budget,
                                        kv_quant=config_for(dtype, calib_tokens=calib_tokens))
        calib = SequenceState(0)
        self.runner.pools.admit(calib)
        prefill(self.runner, calib, calib_prompt)
        self.runner.pools.release(calib)
        while self.runner.pools.poll_kv_quant() is not None:  # calibrating -> ready -> applied
            pass
        self.seq = SequenceState(1)
        self.runner.pools.admit(self.seq)
        self.step_s: list[float] = []

    def step(self, token: int) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.runner.decode([self.seq], [token])[0]
        self.step_s.append(time.perf_counter() - start)
        return logits


def measure(name: str, steps: int, seed: int) -> list[dict]:
    config, context, calib_tokens, init = CONFIGS[name]
    model = build(config, init, seed)
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, config.vocab_size, (context - steps,), generator=g).tolist()
    calib_prompt = torch.randint(0, config.vocab_size, (calib_tokens,), generator=g).tolist()
    probe = ModelRunner.build(model, num_kv_blocks=1, num_ssm_slots=1)
    budget = probe.pools.fp_block_bytes * (2 * -(-(context + calib_tokens) // 16) + 4)
    del probe
    full = Side(model, "auto", budget, calib_prompt, calib_tokens)
    sides = {dtype: Side(model, dtype, budget, calib_prompt, calib_tokens) for dtype in DTYPES}
    logits = {"auto": [prefill(full.runner, full.seq, prompt)]}
    for dtype, side in sides.items():
        assert side.runner.pools.kv_quant_state == "applied"
        logits[dtype] = [prefill(side.runner, side.seq, prompt)]
    tokens = []
    for _ in range(steps):   # full precision chooses; every side reads the same history
        token = int(logits["auto"][-1].argmax())
        tokens.append(token)
        logits["auto"].append(full.step(token))
        for dtype, side in sides.items():
            logits[dtype].append(side.step(token))
    reference = torch.stack(logits["auto"]).log_softmax(-1)  # [steps + 1, V]
    rows = []
    for dtype, side in sides.items():
        quant = torch.stack(logits[dtype]).log_softmax(-1)
        kl = torch.nn.functional.kl_div(quant, reference, log_target=True, reduction="none").sum(-1)
        agree = (quant[:steps].argmax(-1) == torch.tensor(tokens)).float().mean()
        rows.append({
            "config": name, "dtype": dtype,
            "capacity_ratio": round(side.runner.pools.blocks.num_blocks / full.runner.pools.blocks.num_blocks, 3),
            "greedy_agreement": round(float(agree), 4), "logit_kl": float(f"{float(kl.mean()):.3g}"),
            "decode_ms_ratio": round(statistics.median(side.step_s) / statistics.median(full.step_s), 3),
            "context": context, "decode_ms": round(statistics.median(side.step_s) * 1e3, 3),
            "full_decode_ms": round(statistics.median(full.step_s) * 1e3, 3),
            "blocks_quantized": side.runner.pools.blocks.num_quantized,
        })
    return rows



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=64, help="greedy steps compared after the prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help='print one object: {"rows": [...]}')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    rows = [row for name in names for row in measure(name, args.steps, args.seed)]
    if args.json:
        print(json.dumps({"rows": rows, "cpu": cpu_model(), "threads": args.threads, "steps": args.steps}))
        return
    print(f"cpu: {cpu_model()}, {args.threads} thread(s); {args.steps} greedy steps; ratios quantized / full precision")
    print(f"{'config':<16}{'dtype':<9}{'ctx':>6}{'capacity':>10}{'greedy agree':>14}{'logit KL':>11}"
          f"{'decode ms':>11}{'ratio':>8}")
    for r in rows:
        print(f"{r['config']:<16}{r['dtype']:<9}{r['context']:>6}{r['capacity_ratio']:>9.2f}x"
              f"{r['greedy_agreement']:>14.3f}{r['logit_kl']:>11.2e}{r['decode_ms']:>11.2f}"
              f"{r['decode_ms_ratio']:>7.2f}x")


if __name__ == "__main__":
    main()
