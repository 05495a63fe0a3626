"""Grammar masks: tiny-model decode at batch 8 with every row constrained vs none, in one run.

Each configuration is a fresh engine given 8 requests at tick 0 (prompts of ``--prompt-len``
random tokens, ``--max-tokens`` output tokens) and stepped to the end; only decode ticks are
timed (prefill is the same for all). The constrained configurations use grammars that cannot
be complete before ``--max-tokens`` (so every row stays constrained the whole time):

- ``json``: a JSON schema (an array of at least 100 objects with a bounded string and an
  integer range), the common structured-output case and the costlier mask;
- ``regex``: ``[ -~]{N}`` (N printable characters), a lexer-only grammar.

Rounds interleave none / json / regex so machine drift hits all alike. Prints the CPU, the
median decode tick time per configuration, the mask's share of decode tick time (the
``grammar_mask_ns`` each tick records, over the tick's duration) and the tick-time ratio to
unconstrained decoding. Target: mask share <= 15 %.

    python bench/grammar.py [--rounds 3] [--max-tokens 96] [--batch 8]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

# Run as a script, bench/ comes first on sys.path and bench/telemetry.py would shadow the package.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.grammar.compiler import GrammarCompiler  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.model.cpu_features import cpu_model  # noqa: E402

TARGET_SHARE = 0.15
JSON_SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"], "additionalProperties": False}}



def grammar_for(kind: str, max_tokens: int) -> dict | None:
    if kind == "json":
        return {"kind": "json_schema", "value": JSON_SCHEMA}
    if kind == "regex":
        return {"kind": "regex", "value": f"[ -~]{{{max_tokens * 2}}}"}
    return None


def run_once(model, tokenizer, kind: str, args) -> dict:
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=args.batch * (-(-(args.prompt_len + args.max_tokens) // 16) + 1),
                               num_ssm_slots=args.batch)
    sched = Scheduler(runner, defaults(), emit=rows.append,
                      grammars=GrammarCompiler.for_model(model, tokenizer, runner.vocab_size))
    rng = random.Random(0)
    grammar = grammar_for(kind, args.max_tokens)
    for i in range(args.batch):
        sampling = {"temperature": 1.0, "seed": i, "max_tokens": args.max_tokens,
                    "min_tokens": 0 if grammar else args.max_tokens}
        sched.submit(i, [rng.randrange(256) for _ in range(args.prompt_len)], sampling, grammar=grammar)
    if grammar is not None:
        sched.grammars.compile_now(sched.waiting[0].grammar_spec, timeout_s=60)   # compile is not timed
    while sched.has_work:
        sched.step()
    sched.grammars.close()
    ended = [r for r in sched.done]
    assert all(r.num_generated == args.max_tokens for r in ended), "a row ended early: the batch shrank"
    decode = [t for t in rows if isinstance(t, ev.Tick) and t.path == ev.PATH_DECODE and t.num_decode_tokens == args.batch]
    return {"tick_ns": [t.duration_ns for t in decode], "mask_ns": [t.grammar_mask_ns for t in decode],
            "rows": [t.num_constrained_rows for t in decode]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model, _, tokenizer = load_model("tiny")
    kinds = ("none", "json", "regex")
    results: dict[str, dict[str, list]] = {k: {"tick_ns": [], "mask_ns": [], "rows": []} for k in kinds}
    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for kind in kinds:
            for key, values in run_once(model, tokenizer, kind, args).items():
                results[kind][key] += values
    print(f"bench/grammar.py: tiny model, decode batch {args.batch}, {args.max_tokens} tokens/row, "
          f"{args.rounds} rounds; CPU {cpu_model()}, torch {torch.__version__}, 1 thread")
    base = statistics.median(results["none"]["tick_ns"])
    print(f"  none : median decode tick {base / 1e6:.3f} ms")
    worst = 0.0
    for kind in ("json", "regex"):
        r = results[kind]
        assert all(n == args.batch for n in r["rows"]), "a decode tick had an unconstrained row"
        share = sum(r["mask_ns"]) / sum(r["tick_ns"])
        worst = max(worst, share)
        median = statistics.median(r["tick_ns"])
        print(f"  {kind:5}: median decode tick {median / 1e6:.3f} ms ({median / base:.2f}x none), "
              f"mask {statistics.median(r['mask_ns']) / 1e6:.3f} ms/tick, mask share of tick time {share:.1%}")
    verdict = "PASS" if worst <= TARGET_SHARE else "FAIL"
    print(f"  mask share (worst of json, regex) {worst:.1%}; target <= {TARGET_SHARE:.0%}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
