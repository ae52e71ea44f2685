"""agent.toolcall: verl's hermes tool call format parsed into calls, content and a count of
the blocks it dropped."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.toolcall import FORMATS, ParsedTurn, ToolCall, parse_tool_calls


def test_one_call_and_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n' \
           '</tool_call>'
    content, calls, malformed = parse_tool_calls(text)
    assert content == "Let me compute.\n"
    assert calls == [ToolCall("calc", '{"expr": "1+2"}')]
    assert malformed == 0


def test_arguments_are_redumped_without_ascii_escapes():
    text = '<tool_call>{"name":"say","arguments":{"text":"héllo","n":[1,2]}}</tool_call>'
    _, calls, _ = parse_tool_calls(text)
    assert calls[0].arguments == '{"text": "héllo", "n": [1, 2]}'


def test_several_calls_in_order_and_malformed_blocks_counted():
    text = ("a<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
            "b<tool_call>not json</tool_call>"
            "c<tool_call>[1, 2]</tool_call>"
            "d<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>"
            "e<tool_call>{\"name\": \"g\"}</tool_call>"
            "f<tool_call>{\"name\": \"g\", \"arguments\": \"x\"}</tool_call>g")
    parsed = parse_tool_calls(text)
    assert parsed == ParsedTurn("abcdefg", [ToolCall("f", "{}"), ToolCall("g", '"x"')], 4)


def test_unclosed_block_is_content():
    text = 'x <tool_call>{"name": "f", "arguments": {}}'
    assert parse_tool_calls(text) == (text, [], 0)


def test_only_hermes():
    assert FORMATS == ("hermes",)
    with pytest.raises(ValueError, match="'gpt-oss'"):
        parse_tool_calls("x", "gpt-oss")


def test_toolcall_is_a_frozen_struct():
    call = ToolCall("f", "{}")
    assert msgspec.json.decode(msgspec.json.encode(call), type=ToolCall) == call
    with pytest.raises(AttributeError):
        call.name = "g"  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_text_without_a_call_start_is_all_content(text):
    text = text.replace("<tool_call>", "")
    assert parse_tool_calls(text) == (text, [], 0)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_plain = st.text().filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_plain, st.text(min_size=1), _json_values), max_size=4), _plain)
def test_generated_calls_round_trip(parts, tail):
    text = ""
    expected_calls = []
    expected_content = ""
    for prose, name, arguments in parts:
        block = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        if "</tool_call>" in block:  # a string holding the end marker cuts its own block
            continue
        text += prose + "<tool_call>" + block + "</tool_call>"
        expected_content += prose
        expected_calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    text += tail
    expected_content += tail
    content, calls, malformed = parse_tool_calls(text)
    if not expected_calls:
        assert (content, calls, malformed) == (text, [], 0)
        return
    assert (content, calls, malformed) == (expected_content, expected_calls, 0)
