"""Reasoning / tool-call parsing, chat template rendering and text deltas: pure functions."""
from __future__ import annotations

import json

from hypothesis import given, strategies as st

from engine.api.chat_template import ChatTemplate
from engine.api.output_parse import parse_reply, split_reasoning
from engine.api.text_stream import TextStream


def test_reasoning_split():
    assert split_reasoning("plan it\n</think>\n\nanswer", thinking=True) == ("plan it", "answer")
    assert split_reasoning("still thinking", thinking=True) == ("still thinking", "")
    assert split_reasoning("plain answer", thinking=False) == (None, "plain answer")


def test_xml_and_json_tool_calls():
    xml = ("Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    parsed = parse_reply(xml, thinking=False, tools_allowed=True)
    assert parsed.content == "Let me check." and not parsed.tool_call_errors
    call = parsed.tool_calls[0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 3}
    old = '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>'
    parsed = parse_reply(old, thinking=False, tools_allowed=True)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"x": [1, 2]} and parsed.content is None


def test_unparsable_tool_call_is_reported_and_kept():
    parsed = parse_reply("<tool_call>garbage", thinking=False, tools_allowed=True)
    assert parsed.tool_calls == [] and parsed.content == "<tool_call>garbage"
    assert "neither" in parsed.tool_call_errors[0]
    parsed = parse_reply('<tool_call>{"name": "f"', thinking=False, tools_allowed=True)
    assert "does not parse" in parsed.tool_call_errors[0]


def test_builtin_template_renders_qwen_chatml():
    template = ChatTemplate.for_checkpoint(None)
    text = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], None,
                           enable_thinking=False)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = template.render([{"role": "user", "content": "U"}], None, enable_thinking=True)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    tools = [{"type": "function", "function": {"name": "f"}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    text = template.render([{"role": "user", "content": "U"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "content": "R1"}, {"role": "tool", "content": "R2"}], tools,
                           enable_thinking=False)
    assert '"name": "f"' in text and "<function=f>\n<parameter=a>\n1\n</parameter>" in text
    assert text.count("<|im_start|>user") == 2 and "<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2" in text


def test_checkpoint_template_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    text = ChatTemplate.for_checkpoint(tmp_path).render([{"role": "user", "content": "hi"}], None,
                                                        enable_thinking=False)
    assert text == "[user]hi"


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@given(st.text(min_size=1, max_size=30), st.lists(st.integers(1, 5), min_size=1, max_size=30),
       st.sampled_from(["", "ab", "é", "\n\n"]))
def test_text_deltas_join_to_the_cut_text(text, sizes, stop):
    """However tokens arrive, the deltas join to the full text cut before the first stop string."""
    ids = list(text.encode())
    stream = TextStream(byte_decode, (stop,) if stop else ())
    out, i = [], 0
    for size in sizes:
        out.append(stream.push(ids[i:i + size]))
        i += size
    out.append(stream.push(ids[i:]))
    out.append(stream.finish())
    cut = text.find(stop) if stop and stop in text else len(text)
    assert "".join(out) == text[:cut]
