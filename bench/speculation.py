"""N-gram speculation: decode tokens/s with ``speculation`` off vs ngram on a repetitive single stream.

A single stream is where the speculative step runs (decode width 1). The
workload: ``--requests`` greedy requests, one at a time, each prompt a short
random unit repeated (the kind of text prompt lookup is for: code, lists,
quoted passages, a model that loops). Both configurations run the same
requests, interleaved for ``--rounds`` rounds with the order flipped every
round so drift in the machine's load hits both alike.

Prints per configuration the generated tokens, decode time and tokens/s
(from each request's first token to its end, so prefill is left out), both
wall-clock and process CPU time (the CPU figure is steadier when other jobs
share the machine; the engine runs single-threaded on the tiny model),
then the ratio ngram/off, the draft acceptance rate (accepted / drafted) and
the tokens emitted per speculative step, and whether the outputs were
token-identical (they must be: greedy speculation is lossless).

    python bench/speculation.py [--rounds 3] [--requests 6] [--max-tokens 128] [--model tiny]
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
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

CONFIGS = ("off", "ngram")


def make_prompts(num: int, seed: int, vocab: int, length: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        unit = [rng.randrange(min(vocab, 256)) for _ in range(rng.randrange(3, 10))]
        prompts.append((unit * length)[:length])
    return prompts


def run_once(model, prompts, speculation: str, max_tokens: int):
    """All prompts one after the other; returns (outputs, (wall s, CPU s) of decoding, spec_step details)."""
    rows: list = []
    runner = ModelRunner(model, num_kv_blocks=512, num_ssm_slots=2)
    sched = Scheduler(runner, defaults().replace(speculation=speculation), emit=rows.append)
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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name in ("rounds", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    model, config, _ = load_model(args.model)
    prompts = make_prompts(args.requests, args.seed, config.vocab_size)
    run_once(model, prompts[:1], "ngram", 8)  # warm-up: first-call allocations out of the timing
    print(f"workload: {args.requests} repetitive prompts x {args.max_tokens} greedy tokens, single stream, "
          f"{args.rounds} rounds, model {args.model}, {torch.get_num_threads()} threads")
    totals = {name: [0, 0.0, 0.0] for name in CONFIGS}
    spec_all: list[dict] = []
    outputs: dict[str, list] = {}
    order = [(r, name) for r in range(args.rounds) for name in (CONFIGS if r % 2 == 0 else CONFIGS[::-1])]
    for _, name in tqdm(order, desc="runs", unit="run"):
        out, seconds, spec = run_once(model, prompts, name, args.max_tokens)
        totals[name][0] += sum(len(o) - 1 for o in out)  # tokens after the first one
        totals[name][1] += seconds[0]
        totals[name][2] += seconds[1]
        outputs.setdefault(name, out)
        if name == "ngram":
            spec_all += spec

    print(f"\n{'config':<7} {'tokens':>7} {'wall s':>7} {'tok/s':>7} {'CPU s':>7} {'tok/CPU-s':>9}")
    rate, cpu_rate = {}, {}
    for name in CONFIGS:
        tokens, wall, cpu = totals[name]
        rate[name], cpu_rate[name] = tokens / wall, tokens / cpu
        print(f"{name:<7} {tokens:>7} {wall:>7.2f} {rate[name]:>7.1f} {cpu:>7.2f} {cpu_rate[name]:>9.1f}")
    drafted = sum(d["num_drafted"] for d in spec_all)
    accepted = sum(d["num_accepted"] for d in spec_all)
    steps = [d for d in spec_all if d["num_drafted"]]
    emitted = sum(d["num_emitted"] for d in steps)
    print(f"\ntokens/s ratio ngram/off: {rate['ngram'] / rate['off']:.2f} wall, "
          f"{cpu_rate['ngram'] / cpu_rate['off']:.2f} per CPU-second")
    print(f"acceptance rate: {accepted / max(drafted, 1):.2f} ({accepted}/{drafted} drafts), "
          f"{emitted / max(len(steps), 1):.2f} tokens per speculative step, "
          f"{sum(d['rolled_back'] for d in steps)}/{len(steps)} steps rolled back")
    same = outputs["off"] == outputs["ngram"]
    print(f"outputs token-identical off vs ngram: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
