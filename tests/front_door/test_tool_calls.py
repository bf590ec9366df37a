"""The edge's tool-call format (edge.tools), as pure functions: answers split into text and calls
however the stream cuts them, the grammar each tool_choice gets, and history rendered back."""

from __future__ import annotations

import json

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import ToolCallParser, parse_answer
from edge.tools import (
    FunctionIn,
    NamedToolChoiceIn,
    ToolCallIn,
    calls_text,
    tools_for,
    with_tools_described,
)

WEATHER = FunctionIn(
    name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}
)
CLOCK = FunctionIn(name="get_time")
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 11, 64])
def test_calls_stream_out_whole_however_the_answer_is_cut(cut):
    parser = ToolCallParser("chatcmpl-1")
    released, calls = "", []
    for start in range(0, len(TWO_CALLS), cut):
        text, completed = parser.feed(TWO_CALLS[start : start + cut])
        released += text
        calls += completed
    assert released + parser.rest() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert calls == parse_answer(TWO_CALLS, "chatcmpl-1")[1], "call ids are a function of the answer's id"
    assert len({c.id for c in calls}) == 2


def test_text_is_released_once_it_cannot_be_a_call_and_an_unfinished_call_is_kept_as_text():
    parser = ToolCallParser("x")
    assert parser.feed("<to") == ("", [])  # could still become a call
    assert parser.feed("day is sunny") == ("<today is sunny", [])
    assert parse_answer("Hello", "x") == ("Hello", [])
    cut = '<tool_call>{"name": "get_time", "argu'
    assert parse_answer(cut, "x") == (cut, [])


def test_each_tool_choice_gets_its_grammar_and_the_system_turn_describes_the_tools():
    auto = tools_for([WEATHER, CLOCK], None, None)
    assert auto is not None and auto.choice == "auto" and auto.parallel
    assert auto.constraint().grammar.startswith("start: TEXT | calls\ncalls: call (")
    required = tools_for([WEATHER, CLOCK], "required", False)
    assert required is not None and required.constraint().grammar.startswith("start: calls\ncalls: call\n")
    named = tools_for(
        [WEATHER, CLOCK], NamedToolChoiceIn(type="function", function={"name": "get_time"}), None
    )
    assert named is not None and '"const": "get_time"' in named.constraint().grammar
    assert '"const": "get_weather"' not in named.constraint().grammar
    assert tools_for([WEATHER], "none", None) is None
    with pytest.raises(ValueError, match="not among the tools"):
        tools_for([WEATHER], NamedToolChoiceIn(type="function", name="nope"), None)
    with pytest.raises(ValueError, match="only allowed when tools are given"):
        tools_for([], "required", None)
    messages = with_tools_described([chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="hi")], auto)
    assert messages[0].role == chat_pb2.ROLE_SYSTEM and '"name": "get_weather"' in messages[0].content


def test_history_calls_render_back_in_the_format_the_model_writes():
    call = ToolCallIn(id="call_1", function={"name": "get_weather", "arguments": '{"city": "Paris"}'})
    assert calls_text([call]) == TWO_CALLS.split("\n")[0]
