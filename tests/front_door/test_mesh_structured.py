"""Structured outputs and tools through the official ``openai`` SDK, unmodified, against the whole
system on the real model: Envoy -> edge -> orchestrator -> router -> a cpu engine (SmolLM2-135M)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from edge.response_record import run_id_of
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import MeshFactory

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}

# A stored response that must call get_time, once.
TIME_CALL: dict[str, Any] = {
    "model": "",
    "input": "What time is it in Tokyo?",
    "tools": [{"type": "function", **TIME_TOOL["function"]}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "temperature": 0,
    "max_output_tokens": 64,
}


class Person(BaseModel):
    name: str
    age: int
    city: Literal["Paris", "London", "Rome"]


@pytest.fixture(scope="module")
def model_door(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, start_mesh: MeshFactory
) -> Iterator[FrontDoor]:
    mesh = start_mesh(1, "cpu")
    with Launcher(tmp_path_factory.mktemp("structured-door"), echo=lambda line: None) as launcher:
        yield start_front_door(launcher, dev_jwt_keys, [mesh.orchestrator.port])


@pytest.fixture
def sdk(model_door: FrontDoor) -> openai.OpenAI:
    return model_door.sdk("structured-user")


def ask(content: str, system: str | None = None) -> list[dict]:
    return [
        *([{"role": "system", "content": system}] if system else []),
        {"role": "user", "content": content},
    ]


def test_parse_with_a_pydantic_model_gives_a_validated_object(sdk: openai.OpenAI):
    completion = sdk.chat.completions.parse(
        model="",
        messages=ask("Describe a person who lives in Paris, in JSON."),
        response_format=Person,
        temperature=0,
        max_tokens=96,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed.city in ("Paris", "London", "Rome")


def test_parse_cut_by_max_tokens_raises_as_against_openai(sdk: openai.OpenAI):
    with pytest.raises(openai.LengthFinishReasonError):
        sdk.chat.completions.parse(
            model="", messages=ask("Describe a person."), response_format=Person, temperature=0, max_tokens=5
        )


def test_a_streamed_json_object_parses(sdk: openai.OpenAI):
    chunks = list(
        sdk.chat.completions.create(
            model="",
            messages=ask("Give the capital of France as JSON."),
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=64,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_the_structured_outputs_extension_takes_a_choice_and_a_regex(sdk: openai.OpenAI):
    choice = sdk.chat.completions.create(
        model="",
        messages=ask("What is the capital of France?"),
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
        temperature=0,
    )
    assert choice.choices[0].message.content in ("Paris", "Lyon", "Nice")
    year = sdk.chat.completions.create(
        model="",
        messages=ask("In which year did the French Revolution begin?"),
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
        temperature=0,
    )
    assert year.choices[0].message.content.isdigit() and len(year.choices[0].message.content) == 4


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(sdk: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="",
            messages=ask("hi"),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "broken", "schema": {"type": "string", "format": "no-such-format"}},
            },
        )
    error = refused.value.body
    assert error["param"] == "response_format" and "no-such-format" in error["message"]
    assert "sampling" not in error["message"], "the engine's own field names stay inside"


def required_call(sdk: openai.OpenAI, **fields: Any) -> ChatCompletion:
    """A greedy answer that must call one of two tools."""
    return sdk.chat.completions.create(
        model="",
        messages=ask("What is the weather in Paris?"),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        # With parallel calls allowed, this small model calls tool after tool until max_tokens.
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
        **fields,
    )


def test_a_required_tool_call_is_a_tool_call_whose_arguments_follow_the_schema(sdk: openai.OpenAI):
    completion = required_call(sdk)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_named_tool_is_called_streamed_as_deltas_and_its_result_answered(sdk: openai.OpenAI):
    messages = ask("What time is it in Tokyo?")
    stream = sdk.chat.completions.create(
        model="",
        messages=messages,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=64,
        stream=True,
    )
    chunks = list(stream)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_time"] and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, TIME_TOOL["function"]["parameters"])
    # The call and its result go back in the history; with "auto" the model may now answer in text.
    follow_up = sdk.chat.completions.create(
        model="",
        messages=[
            *messages,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": calls[0].id,
                        "type": "function",
                        "function": {"name": "get_time", "arguments": calls[0].function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].id, "content": "09:41"},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
        temperature=0,
        max_tokens=48,
    )
    answer = follow_up.choices[0]
    assert answer.finish_reason in ("stop", "tool_calls", "length")
    assert answer.message.content or answer.message.tool_calls


def test_tool_choice_naming_an_unknown_function_is_a_400(sdk: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="",
            messages=ask("hi"),
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert refused.value.body["param"] == "tool_choice"


def test_responses_parse_with_a_pydantic_text_format_gives_a_validated_object(sdk: openai.OpenAI):
    response = sdk.responses.parse(
        model="",
        input="Describe a person who lives in Rome, in JSON.",
        text_format=Person,
        temperature=0,
        max_output_tokens=96,
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Person)
    assert response.text.format.type == "json_schema"


def test_a_stored_responses_function_call_is_answered_with_its_output(sdk: openai.OpenAI):
    called = sdk.responses.create(**TIME_CALL)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TIME_TOOL["function"]["parameters"])
    again = sdk.responses.retrieve(called.id)
    assert [item.model_dump() for item in again.output] == [call.model_dump()], "the same items, read again"
    answered = sdk.responses.create(
        model="",
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "09:41"}],
        tools=TIME_CALL["tools"],
        temperature=0,
        max_output_tokens=48,
    )
    assert answered.status in ("completed", "incomplete") and answered.output


def test_a_streamed_responses_function_call_is_its_items_events_and_its_output_is_answered_streamed(
    sdk: openai.OpenAI,
):
    with sdk.responses.stream(**TIME_CALL) as stream:
        events = list(stream)
        called = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_time" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME_TOOL["function"]["parameters"])
    assert events[3].snapshot == call.arguments, "the SDK's accumulated arguments are the call's"
    stored = sdk.responses.retrieve(called.id)
    assert [item.model_dump() for item in stored.output] == [call.model_dump(exclude={"parsed_arguments"})]
    # The stream read again from the store: the same events, numbered the same.
    replayed = list(sdk.responses.retrieve(called.id, stream=True))
    assert [(e.type, e.sequence_number) for e in replayed] == [(k, i) for i, k in enumerate(kinds)]
    answered = sdk.responses.create(
        model="",
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "09:41"}],
        tools=TIME_CALL["tools"],
        temperature=0,
        max_output_tokens=48,
        stream=True,
    )
    last = list(answered)[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.previous_response_id == called.id and last.response.output


def test_a_stored_chat_keeps_the_call_and_its_result_as_messages_that_later_turns_read(
    sdk: openai.OpenAI, model_door: FrontDoor
):
    called = sdk.responses.create(**TIME_CALL)
    [call] = called.output
    with model_door.client("structured-user") as rest:
        run = rest.get(f"/v1/runs/{run_id_of(called.id, None)}").json()
        chat_id, asked = run["chat_id"], f"/v1/chats/{run['chat_id']}/messages"
        # Results that do not answer the calls are refused, naming what is wrong; nothing is stored.
        refusals = [
            (
                {"tool_results": [{"tool_call_id": "call_nope", "content": "1"}]},
                "tool_results[0].tool_call_id",
            ),
            (
                {"tool_results": [{"tool_call_id": call.call_id, "content": "1"}] * 2},
                "tool_results[1].tool_call_id",
            ),
            ({"content": "hi", "tool_results": [{"tool_call_id": call.call_id, "content": "1"}]}, "content"),
        ]
        for body, param in refusals:
            refused = rest.post(asked, json={**body, "parent_message_id": run["assistant_message_id"]})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param, refused.text
        assert len(rest.get(asked).json()["messages"]) == 2
    answered = sdk.responses.create(
        model="",
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "09:41"}],
        tools=TIME_CALL["tools"],
        temperature=0,
        max_output_tokens=48,
    )
    with model_door.client("structured-user") as rest:
        messages = rest.get(f"/v1/chats/{chat_id}/messages").json()["messages"][::-1]
    calling, result = messages[1:3]
    assert [m["role"] for m in messages[:3]] == ["user", "assistant", "tool"]
    assert calling["content"] == "" and calling["tool_calls"] == [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": "get_time", "arguments": call.arguments},
        }
    ]
    assert result["tool_call_id"] == call.call_id and result["name"] == "get_time"
    assert result["content"] == "09:41" and result["parent_id"] == calling["message_id"]
    assert result["token_count"] > 0, "counted with the model's tokenizer"
    assert result["run_id"] == run_id_of(answered.id, None), "the run that answers it"
    # The answer's prompt is the chat's branch: the question, the call and its result all went in.
    assert answered.usage.input_tokens > called.usage.input_tokens + called.usage.output_tokens


def test_each_of_n_choices_parses_and_calls_tools_under_ids_of_its_own(sdk: openai.OpenAI):
    parsed = sdk.chat.completions.parse(
        model="",
        messages=ask("Describe a person who lives in Paris, in JSON."),
        response_format=Person,
        temperature=0.7,
        seed=3,
        n=2,
        max_tokens=96,
    )
    assert [choice.index for choice in parsed.choices] == [0, 1]
    assert all(isinstance(choice.message.parsed, Person) for choice in parsed.choices)
    called = required_call(sdk, n=2)
    [first], [second] = (choice.message.tool_calls for choice in called.choices)
    assert first.function == second.function  # greedy: the same call
    assert first.id != second.id
