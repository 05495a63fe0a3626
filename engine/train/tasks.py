"""The seeded chat tasks ``tiny-chat`` is trained on and the chat workload serves.

Each draw is one exchange in Qwen3.5's conventions: the messages up to the user's turn (with the
tools offered, if any), whether thinking is on, the thought (short, closed by ``</think>``), and
the reply: plain text (lists, code fences, phrases repeated from the question), a tool call in
the template's XML form or the compact JSON form a required tool call is held to, or a compact
JSON answer of one of the workload's schemas. Replies copy what the question says (names,
cities, numbers), so prompt-lookup and MTP drafts have something to get right.

Pure Python and deterministic for a ``random.Random``: the trainer, the bench and the chat
workload draw from the same tasks.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

CITIES = ("Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Madrid", "Seoul", "Austin", "Dublin")
NAMES = ("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar")
TOPICS = ("tea", "trains", "rain", "python", "music", "chess", "bread", "rockets", "maps", "birds")
THINGS = {"fruits": ("apple", "pear", "plum", "fig", "lime", "kiwi"),
          "colors": ("red", "green", "blue", "yellow", "black", "white"),
          "animals": ("cat", "dog", "fox", "owl", "bee", "cow"),
          "tools": ("saw", "drill", "hammer", "wrench", "file", "ruler")}
WEATHER = ("sunny", "cloudy", "rainy", "windy", "snowy")


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS: tuple[dict[str, Any], ...] = (
    _tool("get_weather", "Weather in a city.", {"city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          ["city"]),
    _tool("get_time", "Local time in a city.", {"city": {"type": "string"}}, ["city"]),
    _tool("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    _tool("search", "Search the web.", {"query": {"type": "string"}}, ["query"]),
    _tool("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"}}, ["to", "subject"]),
    _tool("set_timer", "Start a timer.", {"minutes": {"type": "integer"}}, ["minutes"]),
)
TOOL_BY_NAME = {t["function"]["name"]: t for t in TOOLS}

KIND_TEXT, KIND_TOOL, KIND_JSON = "text", "tool", "json"


@dataclass
class ChatTask:
    """One exchange. ``reply`` is what follows the think block (a tool call included)."""

    kind: str                              # text | tool | json
    messages: list[dict[str, Any]]         # up to and including the user's turn
    tools: list[dict[str, Any]] | None
    thinking: bool
    thought: str
    reply: str
    schema: dict[str, Any] | None = None   # json: the answer's schema (the workload's grammar)
    tool_call: dict[str, Any] | None = None  # tool: {"name", "arguments"}
    history: list[dict[str, Any]] = field(default_factory=list)


def _think(rng: random.Random, opening: str, steps: list[str], close: str) -> str:
    """A thought of one to four sentences: what was asked, a few steps, the conclusion."""
    return " ".join([opening, *steps[:rng.randint(0, len(steps))], close])


# ---- plain text -----------------------------------------------------------------------------
def _greeting(rng: random.Random) -> tuple[str, str, str]:
    name = rng.choice(NAMES)
    question = f"Say hello to {name}."
    thought = _think(rng, f"The user wants me to say hello to {name}.", [
        f"{name} is a name.", "A greeting should be short.", f"I will greet {name} by name."],
        f"So I say hello to {name}.")
    return question, thought, f"Hello, {name}! Nice to meet you, {name}."


def _listing(rng: random.Random) -> tuple[str, str, str]:
    group = rng.choice(sorted(THINGS))
    count = rng.randint(2, 5)
    items = rng.sample(THINGS[group], count)
    question = f"List {count} {group}."
    thought = _think(rng, f"The user asks for a list of {count} {group}.", [
        f"Some {group} are {', '.join(items)}.", f"I need exactly {count} of them.", "A numbered list is clear."],
        f"So the list has {count} {group}.")
    lines = "\n".join(f"{i + 1}. {item}" for i, item in enumerate(items))
    return question, thought, f"Here are {count} {group}:\n{lines}"


def _code(rng: random.Random) -> tuple[str, str, str]:
    number, name = rng.randint(0, 99), rng.choice(("answer", "value", "number", "result"))
    question = f"Write a python function {name} that returns {number}."
    thought = _think(rng, f"The user wants a python function named {name}.", [
        f"It takes no arguments and returns {number}.", "A code fence keeps the code apart."],
        f"So {name} returns {number}.")
    return question, thought, f"```python\ndef {name}():\n    return {number}\n```"


def _repeat(rng: random.Random) -> tuple[str, str, str]:
    phrase = " ".join(rng.sample(TOPICS, rng.randint(1, 3)))
    times = rng.randint(2, 4)
    question = f"Repeat the words {phrase} {times} times."
    thought = _think(rng, f"The user asks me to repeat {phrase} {times} times.", [
        f"The words are {phrase}.", "I write them on one line."], f"So I write {phrase} {times} times.")
    return question, thought, " ".join([phrase] * times)


def _city_weather(rng: random.Random) -> tuple[str, str, str]:
    city, sky = rng.choice(CITIES), rng.choice(WEATHER)
    question = f"Describe a {sky} day in {city}."
    thought = _think(rng, f"The user asks about a {sky} day in {city}.", [
        f"{city} is a city.", f"On a {sky} day people in {city} go outside less or more."],
        f"So I describe a {sky} day in {city}.")
    return question, thought, f"A {sky} day in {city} is calm. In {city}, a {sky} day starts early and ends late."


TEXT_TASKS = (_greeting, _listing, _code, _repeat, _city_weather)


# ---- tool calls -----------------------------------------------------------------------------
def _tool_request(rng: random.Random) -> tuple[str, str, dict[str, Any], str]:
    """(the tool, the user's question, the call's arguments, the result a tool would return)."""
    name, (question, arguments, result) = _tool_question(rng)
    return name, question, arguments, result


def _tool_question(rng: random.Random) -> tuple[str, tuple[str, dict[str, Any], str]]:
    name = rng.choice(sorted(TOOL_BY_NAME))
    city, person, topic = rng.choice(CITIES), rng.choice(NAMES), rng.choice(TOPICS)
    if name == "get_weather":
        arguments = {"city": city, **({"unit": rng.choice(("celsius", "fahrenheit"))} if rng.random() < 0.5 else {})}
        unit = f" in {arguments['unit']}" if "unit" in arguments else ""
        return name, (f"What is the weather in {city}{unit}?", arguments,
                      f"{rng.randint(-5, 35)} degrees and {rng.choice(WEATHER)}")
    if name == "get_time":
        return name, (f"What time is it in {city}?", {"city": city}, f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}")
    if name == "add":
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return name, (f"Add {a} and {b}.", {"a": a, "b": b}, str(a + b))
    if name == "search":
        return name, (f"Search the web for {topic}.", {"query": topic}, f"{topic}: {rng.randint(2, 90)} results")
    if name == "send_email":
        return name, (f"Send an email to {person} about {topic}.", {"to": person, "subject": topic},
                      f"email to {person} sent")
    minutes = rng.randint(1, 90)
    return name, (f"Set a timer for {minutes} minutes.", {"minutes": minutes}, f"timer set for {minutes} minutes")


def xml_call(call: dict[str, Any]) -> str:
    """A call in the chat template's form (``<function=NAME><parameter=P>``)."""
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in call["arguments"].items())
    return f"<tool_call>\n<function={call['name']}>\n{body}</function>\n</tool_call>"


def json_call(call: dict[str, Any]) -> str:
    """A call in the compact JSON form a required tool call's grammar holds it to."""
    return f"<tool_call>\n{json.dumps(call, separators=(',', ':'))}\n</tool_call>"


def draw_tool_task(rng: random.Random, thinking: bool, *, form: str | None = None) -> ChatTask:
    name, question, arguments, result = _tool_request(rng)
    call = {"name": name, "arguments": arguments}
    others = [t for t in TOOLS if t["function"]["name"] != call["name"]]
    tools = rng.sample(others, rng.randint(0, 2)) + [TOOL_BY_NAME[call["name"]]]
    rng.shuffle(tools)
    args_text = ", ".join(f"{k} {v}" for k, v in arguments.items())
    thought = _think(rng, f"The user asks: {question}", [
        f"I have the tool {call['name']}.", f"The arguments are {args_text}."],
        f"So I call {call['name']} with {args_text}.")
    form = form or rng.choice(("xml", "json"))
    reply = xml_call(call) if form == "xml" else json_call(call)
    task = ChatTask(KIND_TOOL, [{"role": "user", "content": question}], tools, thinking, thought, reply,
                    tool_call=call)
    if rng.random() < 0.3:  # the call answered: a second turn quoting the tool's result
        task.history = [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call["name"], "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "content": result}]
        task.thought = _think(rng, f"The tool {call['name']} returned {result}.", [], f"So the answer is {result}.")
        task.reply, task.tool_call = f"The result of {call['name']} is {result}.", None
    return task



# ---- JSON answers (the chat workload's schemas: engine/workload/grammars.py) ------------------
def _json_answer(rng: random.Random, index: int) -> tuple[str, str, Any]:
    """(question, the thought's facts, the answer) for ``SCHEMAS[index]``."""
    if index == 0:
        name, age = rng.choice(NAMES), rng.randint(1, 99)
        return f"Give the name and age of {name}, who is {age}, as JSON.", f"the name is {name} and the age is {age}", \
            {"name": name, "age": age}
    if index == 1:
        status, code = rng.choice(("ok", "error", "pending")), rng.choice((200, 201, 404, 500, 503))
        return f"Report status {status} with code {code} as JSON.", f"the status is {status} and the code is {code}", \
            {"status": status, "code": code}
    if index == 2:
        numbers = [rng.randint(-50, 50) for _ in range(rng.randint(1, 5))]
        listed = ", ".join(map(str, numbers))
        return f"Put the numbers {listed} in a JSON array.", f"the numbers are {listed}", numbers
    if index == 3:
        uid, role = rng.randint(1, 9999), rng.choice(("admin", "user", "guest"))
        tags = rng.sample([t for t in TOPICS if len(t) <= 6], rng.randint(0, 3))
        return (f"Describe user {uid} with role {role} and tags {', '.join(tags) or 'none'} as JSON.",
                f"the user id is {uid}, the role is {role}", {"user": {"id": uid, "role": role}, "tags": tags})
    topic, score = rng.choice(TOPICS), rng.randint(0, 10)
    return f"Rate {topic} from 0 to 10 as JSON.", f"{topic} gets a score of {score}", \
        {"ok": score >= 5, "score": score, "note": topic}


def draw_json_task(rng: random.Random, thinking: bool, schema_index: int | None = None) -> ChatTask:
    from engine.workload.grammars import SCHEMAS
    index = rng.randrange(len(SCHEMAS)) if schema_index is None else schema_index
    question, facts, answer = _json_answer(rng, index)
    thought = _think(rng, f"The user wants JSON: {question}", [f"I see that {facts}.", "JSON keys need quotes."],
                     f"So the JSON says {facts}.")
    return ChatTask(KIND_JSON, [{"role": "user", "content": question}], None, thinking, thought,
                    json.dumps(answer, separators=(",", ":")), schema=SCHEMAS[index])


def draw_text_task(rng: random.Random, thinking: bool) -> ChatTask:
    question, thought, reply = rng.choice(TEXT_TASKS)(rng)
    messages = [{"role": "user", "content": question}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    return ChatTask(KIND_TEXT, messages, None, thinking, thought, reply)


def draw_task(rng: random.Random, *, thinking: bool | None = None, kind: str | None = None) -> ChatTask:
    """One task: text, tool or JSON (2 : 1 : 1 unless ``kind``), thinking on half the time unless given."""
    kind = kind or rng.choice((KIND_TEXT, KIND_TEXT, KIND_TOOL, KIND_JSON))
    thinking = rng.random() < 0.5 if thinking is None else thinking
    if kind == KIND_TOOL:
        return draw_tool_task(rng, thinking)
    if kind == KIND_JSON:
        return draw_json_task(rng, thinking)
    return draw_text_task(rng, thinking)
