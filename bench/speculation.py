"""Speculation kinds side by side: acceptance, tokens per verify step and tokens per CPU-second vs off, batch 1.

A single stream is where the speculative step runs (decode width 1). The
workload: ``--requests`` greedy requests, one at a time; half the prompts are a
short random unit repeated (what prompt lookup is for: code, lists, a looping
model), half are random printable text (what the MTP head was distilled on).
Every configuration (off, ngram, mtp, self) runs the same requests, interleaved
for ``--rounds`` rounds with the order rotated every round so drift in the
machine's load hits all alike.

Prints the CPU model, then per configuration the generated tokens, decode time
and tokens/s (from each request's first token to its end, so prefill is left
out), both wall-clock and process CPU time (the CPU figure is steadier when
other jobs share the machine), the ratio to off, the draft acceptance rate
(accepted / drafted) and the tokens emitted per verify step; then the MTP
head's acceptance on the model's own greedy continuations (the off outputs:
row p drafts the token at p + 2 from the token at p + 1 and the hidden state at
p, compared with the model's greedy token); and whether every kind's outputs
were token-identical to off (they must be: greedy speculation is lossless).

    python bench/speculation.py [--rounds 2] [--requests 6] [--max-tokens 96] [--num-speculative-tokens 2]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

# Run as a script, bench/ comes first on sys.path and bench/telemetry.py would shadow the
# telemetry package; the repo root (or the installed package) is what is meant.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.model.loader import load_model  # noqa: E402
from engine.model.mtp_train import greedy_acceptance  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

CONFIGS = ("off", "ngram", "mtp", "self")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def make_prompts(num: int, seed: int, vocab: int, length: int = 48) -> list[list[int]]:
    """Even indices: a random unit repeated; odd: random printable bytes."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        if i % 2 == 0:
            unit = [rng.randrange(min(vocab, 256)) for _ in range(rng.randrange(3, 10))]
            prompts.append((unit * length)[:length])
        else:
            prompts.append([rng.randrange(32, min(vocab, 127)) for _ in range(length // 2)])
    return prompts


def run_once(model, prompts, speculation: str, max_tokens: int, num_drafts: int):
    """All prompts one after the other; returns (outputs, (wall s, CPU s) of decoding, spec_step details)."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=512, num_ssm_slots=2)
    levers = defaults().replace(speculation=speculation, num_speculative_tokens=num_drafts)
    sched = Scheduler(runner, levers, emit=rows.append)
    if sched.levers.speculation != speculation:
        raise SystemExit(f"the model refuses speculation={speculation}")
    outputs, wall_s, cpu_s = [], 0.0, 0.0
    for i, prompt in enumerate(prompts):
        request = sched.submit(i, prompt, {"max_tokens": max_tokens})
        first_token_at = None
        while sched.step():
            if first_token_at is None and request.output_tokens:
                first_token_at = (time.perf_counter(), time.process_time())
        wall_s += time.perf_counter() - first_token_at[0]
        cpu_s += time.process_time() - first_token_at[1]
        outputs.append(request.output_tokens)
    spec = [r.detail for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"]
    return outputs, (wall_s, cpu_s), spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in ("rounds", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= args.num_speculative_tokens <= 8:
        p.error("--num-speculative-tokens must be in 1..8")

    model, config, _ = load_model(args.model)
    configs = [c for c in CONFIGS if c != "mtp" or model.has_mtp_head]
    prompts = make_prompts(args.requests, args.seed, config.vocab_size)
    k = args.num_speculative_tokens
    for name in configs:  # warm-up: first-call allocations out of the timing
        run_once(model, prompts[:1], name, 8, k)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads")
    print(f"workload: {args.requests} prompts (half repetitive, half random text) x {args.max_tokens} greedy "
          f"tokens, batch 1, k = {k} drafts per step, {args.rounds} rounds, model {args.model}")
    totals = {name: [0, 0.0, 0.0] for name in configs}
    spec_all: dict[str, list[dict]] = {name: [] for name in configs}
    outputs: dict[str, list] = {}
    order = [(r, name) for r in range(args.rounds)
             for name in configs[r % len(configs):] + configs[:r % len(configs)]]
    for _, name in tqdm(order, desc="runs", unit="run"):
        out, seconds, spec = run_once(model, prompts, name, args.max_tokens, k)
        totals[name][0] += sum(len(o) - 1 for o in out)  # tokens after the first one
        totals[name][1] += seconds[0]
        totals[name][2] += seconds[1]
        outputs.setdefault(name, out)
        spec_all[name] += spec

    print(f"\n{'kind':<6} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'CPU s':>7} {'tok/CPU-s':>9} "
          f"{'vs off':>7} {'accept':>7} {'tok/step':>8} {'identical':>9}")
    cpu_rate = {}
    for name in configs:
        tokens, wall, cpu = totals[name]
        cpu_rate[name] = tokens / cpu
        steps = [d for d in spec_all[name] if d["num_drafted"]]
        drafted = sum(d["num_drafted"] for d in steps)
        accepted = sum(d["num_accepted"] for d in steps)
        per_step = sum(d["num_emitted"] for d in steps) / len(steps) if steps else 1.0
        acceptance = f"{accepted / drafted:.2f}" if drafted else "-"
        same = outputs[name] == outputs["off"]
        print(f"{name:<6} {tokens:>7} {wall:>7.2f} {tokens / wall:>7.1f} {cpu:>7.2f} {cpu_rate[name]:>9.1f} "
              f"{cpu_rate[name] / cpu_rate['off']:>6.2f}x {acceptance:>7} {per_step:>8.2f} {str(same):>9}")
    if model.has_mtp_head:
        sequences = [p + o for p, o in zip(prompts, outputs["off"])]
        first_rows = [len(p) - 1 for p in prompts]  # the rows that draft the continuation itself
        print(f"\nMTP head acceptance on the model's own greedy continuations: "
              f"{greedy_acceptance(model, sequences, first_rows):.2f} "
              f"(over {sum(len(s) - 1 - f for s, f in zip(sequences, first_rows))} positions)")
    identical = all(outputs[name] == outputs["off"] for name in configs)
    print(f"outputs token-identical to off for every kind: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
