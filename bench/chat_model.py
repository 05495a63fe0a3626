"""tiny-chat's rules through the engine, in one run: thinking ends, required tool calls, speculation acceptance.

Three measurements on the shipped ``tiny-chat`` (engine/model/tiny_chat/), each through the real
scheduler (first-token rules, grammars, stop ids) with the requests the chat workload sends:

1. thinking: ``--requests`` seeded chat requests with thinking on (text, tool-offering and JSON
   tasks alike, sampled at temperature 0.7 with per-request seeds); how many write ``</think>``
   within their first 256 tokens.
2. tools: ``--requests`` seeded tool requests with ``tool_choice="required"`` (the call's grammar,
   token 0 forced to ``<tool_call>``), thinking off; how many replies hold a tool call that the
   API's parser reads (engine/api/output_parse.py) and whose arguments validate against the
   tool's ``parameters`` schema (jsonschema), closed before ``max_tokens``.
   Then, with no bar: ``--copy-requests`` greedy questions whose answer must repeat their facts
   (a name, a number, a city and its weather): how often it does (the tiny models copy poorly).
3. speculation: the default workload (``--workload chat``, seed 0, its first ``--spec-requests``
   requests, one at a time so every decode step is speculative) under speculation off, ngram,
   mtp and self (ngram at the ``ngram_min_match`` lever's default 1 and at 3, what ./run.sh
   sets); per kind the acceptance (accepted / drafted), tokens per forward of a
   speculative step, and whether greedy outputs equal off's.

Prints the CPU model and the dtype; exits 1 when a bar is missed (thinking or tools < 90 %,
ngram at ./run.sh's setting or mtp acceptance < 0.5).

    python bench/chat_model.py [--requests 100] [--spec-requests 24] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/telemetry.py would shadow the telemetry package

import jsonschema  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.api.chat_template import ChatTemplate  # noqa: E402
from engine.api.output_parse import parse_reply  # noqa: E402
from engine.grammar.tools import tool_call_spec  # noqa: E402
from engine.model.cpu_features import cpu_model  # noqa: E402
from engine.serve.engine_setup import build_engine  # noqa: E402
from engine.train.tasks import CITIES, NAMES, TOOL_BY_NAME, WEATHER, draw_task, draw_tool_task  # noqa: E402
from engine.workload.chat import ChatWorkload, task_kind  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

THINK_BUDGET = 256
# (label, speculation, ngram_min_match): ngram with the lever's default (1) and ./run.sh's setting (3)
CONFIGS = (("off", "off", 1), ("ngram/1", "ngram", 1), ("ngram/3", "ngram", 3), ("mtp", "mtp", 1), ("self", "self", 1))
RUN_SH_NGRAM = "ngram/3"


def engine(model: str, speculation: str, dtype: str, rows: list | None = None, ngram_min_match: int = 1):
    levers = defaults().replace(speculation=speculation, ngram_min_match=ngram_min_match)
    return build_engine(model, kv_blocks=1024, ssm_slots=16, levers=levers, dtype=dtype,
                        emit=rows.append if rows is not None else None, prefix_cache=False)


def run_all(setup, requests: list[dict], *, one_at_a_time: bool = False, desc: str = "") -> list:
    """Submit ``requests`` (dicts of submit's arguments) and step until every one has ended."""
    sched, done = setup.scheduler, []
    batches = [[r] for r in requests] if one_at_a_time else [requests]
    for batch in tqdm(batches, desc=desc, unit="req" if one_at_a_time else "batch", leave=False):
        live = [sched.submit(len(done) + i, **r) for i, r in enumerate(batch)]
        deadline = time.monotonic() + 600
        while any(q.finish_reason is None for q in live):
            if not sched.step():
                time.sleep(0.002)  # a grammar still compiling off the tick loop
            if time.monotonic() > deadline:
                raise SystemExit(f"{desc}: requests still running after 600 s")
        done += live
    return done


def thinking_requests(setup, template: ChatTemplate, num: int, seed: int) -> list[dict]:
    rng, im_end = random.Random(f"{seed}:thinking"), setup.tokenizer.token_id("<|im_end|>")
    out = []
    for i in range(num):
        task = draw_task(rng, thinking=True)
        prompt = template.render(task.messages + task.history, task.tools, enable_thinking=True)
        out.append({"prompt_tokens": setup.tokenizer.encode(prompt), "features": {"enable_thinking": True},
                    "sampling": {"temperature": 0.7, "seed": seed * 1000 + i, "max_tokens": THINK_BUDGET,
                                 "stop_token_ids": [im_end]}})
    return out


def tool_requests(setup, template: ChatTemplate, num: int, seed: int) -> tuple[list[dict], list[list[dict]]]:
    rng, tok = random.Random(f"{seed}:tools"), setup.tokenizer
    start, end, im_end = (tok.token_id(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>"))
    out, tools = [], []
    for i in range(num):
        task = draw_tool_task(rng, False)
        while task.tool_call is None:  # a task answering a tool's result asks for no call
            task = draw_tool_task(rng, False)
        prompt = template.render(task.messages, task.tools, enable_thinking=False)
        grammar = tool_call_spec(task.tools, start_id=start, end_id=end).to_dict()
        out.append({"prompt_tokens": tok.encode(prompt), "features": {"require_tool_call": True}, "grammar": grammar,
                    "sampling": {"temperature": 0.7, "seed": seed * 1000 + i, "max_tokens": 160,
                                 "stop_token_ids": [im_end]}})
        tools.append(task.tools)
    return out, tools


def copy_requests(setup, template: ChatTemplate, num: int, seed: int) -> tuple[list[dict], list[list[str]]]:
    """Greedy questions whose answer must repeat their facts (a name, a number, a city and its weather),
    thinking on every other one; (requests, the facts each answer must hold)."""
    rng, im_end = random.Random(f"{seed}:copies"), setup.tokenizer.token_id("<|im_end|>")
    out, facts = [], []
    for i in range(num):
        if i % 3 == 0:
            name = rng.choice(NAMES)
            question, want = f"Say hello to {name}.", [name]
        elif i % 3 == 1:
            number = rng.randint(0, 999)
            question, want = f"Write a python function value that returns {number}.", [str(number)]
        else:
            city, sky = rng.choice(CITIES), rng.choice(WEATHER)
            question, want = f"Describe a {sky} day in {city}.", [city, sky]
        thinking = i % 2 == 0
        prompt = template.render([{"role": "user", "content": question}], None, enable_thinking=thinking)
        out.append({"prompt_tokens": setup.tokenizer.encode(prompt), "features": {"enable_thinking": thinking},
                    "sampling": {"temperature": 0.0, "max_tokens": THINK_BUDGET, "stop_token_ids": [im_end]}})
        facts.append(want)
    return out, facts


def valid_call(text: str, offered: list[dict]) -> bool:
    reply = parse_reply(text, thinking=False, tools_allowed=True)
    if len(reply.tool_calls) != 1 or reply.tool_call_errors:
        return False
    call = reply.tool_calls[0]["function"]
    names = {t["function"]["name"] for t in offered}
    if call["name"] not in names:
        return False
    try:
        jsonschema.validate(json.loads(call["arguments"]), TOOL_BY_NAME[call["name"]]["function"]["parameters"])
    except jsonschema.ValidationError:
        return False
    return True


def speculation_table(model: str, dtype: str, num: int) -> dict[str, tuple[float, float]]:
    base = engine(model, "off", dtype)
    workload = ChatWorkload(tokenizer=base.tokenizer, template=ChatTemplate.for_checkpoint(base.checkpoint_dir),
                            num_requests=num, seed=0)
    specs = workload.requests()
    requests = [{"prompt_tokens": s.prompt_tokens, "sampling": s.sampling, "features": s.features,
                 "grammar": s.grammar} for s in specs]
    kinds = {k: sum(task_kind(s) == k for s in specs) for k in ("text", "tool", "json")}
    print(f"\nspeculation: the default workload (chat, seed 0), its first {num} requests {kinds}, one at a time")
    print(f"{'kind':<8} {'drafted':>8} {'accepted':>8} {'accept':>7} {'tok/forward':>11} {'greedy = off':>12}")
    outputs, table = {}, {}
    for kind, speculation, min_match in CONFIGS:
        rows: list = []
        setup = base if kind == "off" else engine(model, speculation, dtype, rows, min_match)
        done = run_all(setup, requests, one_at_a_time=True, desc=kind)
        outputs[kind] = [q.output_tokens for q, s in zip(done, specs) if s.sampling["temperature"] == 0.0]
        steps = [r.detail for r in rows if isinstance(r, ev.GenericEvent) and r.kind == "spec_step"
                 and r.detail["num_drafted"]]
        if kind == "off":
            continue
        drafted = sum(d["num_drafted"] for d in steps)
        accepted = sum(d["num_accepted"] for d in steps)
        per_forward = sum(d["num_emitted"] for d in steps) / max(1, len(steps))
        table[kind] = (accepted / max(1, drafted), per_forward)
        print(f"{kind:<8} {drafted:>8} {accepted:>8} {table[kind][0]:>7.2f} {per_forward:>11.2f} "
              f"{str(outputs[kind] == outputs['off']):>12}")
    print("(off: 1.00 token per forward; ngram/N: the ngram_min_match lever at N, ./run.sh sets 3)")
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100, help="thinking and tool requests, each")
    p.add_argument("--spec-requests", type=int, default=24, help="default-workload requests per speculation kind")
    p.add_argument("--copy-requests", type=int, default=60, help="greedy questions whose answer must repeat their facts")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny-chat", help="tiny-chat (default) or a checkpoint directory trained the same way")
    args = p.parse_args()
    if min(args.requests, args.spec_requests, args.copy_requests) < 1:
        p.error("--requests, --spec-requests and --copy-requests must be >= 1")
    setup = engine(args.model, "off", args.dtype)
    template = ChatTemplate.for_checkpoint(setup.checkpoint_dir)
    print(f"CPU: {cpu_model()}; dtype {setup.engine_config['dtype']} (--dtype {args.dtype}); model {args.model}")

    done = run_all(setup, thinking_requests(setup, template, args.requests, args.seed), desc="thinking")
    think_end = setup.tokenizer.token_id("</think>")
    ended = sum(think_end in q.output_tokens[:THINK_BUDGET] for q in done)
    thinking_share = ended / len(done)
    lengths = sorted(q.output_tokens.index(think_end) + 1 for q in done if think_end in q.output_tokens)
    median = lengths[len(lengths) // 2] if lengths else "-"
    print(f"thinking: </think> within {THINK_BUDGET} tokens in {ended}/{len(done)} requests "
          f"({ended / len(done):.0%}); median thought {median} tokens")

    requests, offered = tool_requests(setup, template, args.requests, args.seed)
    done = run_all(setup, requests, desc="tools")
    valid = sum(valid_call(setup.tokenizer.decode(q.output_tokens), tools) for q, tools in zip(done, offered))
    tool_share = valid / len(done)
    print(f"tools (tool_choice required): a call that parses and validates in {valid}/{len(done)} "
          f"({valid / len(done):.0%})")

    requests, facts = copy_requests(setup, template, args.copy_requests, args.seed)
    done = run_all(setup, requests, desc="copies")
    answers = [setup.tokenizer.decode(q.output_tokens).split("</think>")[-1] for q in done]
    copied = sum(all(re.search(rf"(?<!\w){re.escape(f)}(?!\w)", answer) for f in want)   # 7 is not in 17
                 for answer, want in zip(answers, facts))
    print(f"copies (no bar): the answer repeats the question's name / number / city and weather in "
          f"{copied}/{len(done)} greedy requests")

    table = speculation_table(args.model, args.dtype, args.spec_requests)
    ok = (thinking_share >= 0.9 and tool_share >= 0.9
          and table[RUN_SH_NGRAM][0] >= 0.5 and table["mtp"][0] >= 0.5)
    print(f"\nall bars met (thinking, tools >= 90 %; {RUN_SH_NGRAM}, mtp acceptance >= 0.5): {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
