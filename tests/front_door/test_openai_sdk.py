"""The official ``openai`` SDK, unmodified, against the OpenAI-compatible API through the real Envoy and
edge, answered by ScriptedChatService (not the orchestrator)."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from chatmesh.chat.v1 import chat_pb2
from edge.chat_client.linked_run import START_ATTEMPTS
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.scripted_chat_service import MODEL, scripted_text


@pytest.fixture
def sdk(front_door: ScriptedFrontDoor, user: str) -> openai.OpenAI:
    return front_door.sdk(user)


def test_streaming_without_usage_has_no_usage_chunk(sdk: openai.OpenAI):
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "!tokens 2 1"}], stream=True
        )
    )
    assert all(c.choices for c in chunks)


def test_sampling_options_reach_the_chat_service(front_door: ScriptedFrontDoor, sdk: openai.OpenAI):
    sdk.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "!tokens 1 1"}],
            },
        ],
        temperature=0.3,
        top_p=0.9,
        seed=42,
        stop=["\n\n", "END"],
        max_completion_tokens=7,
    )
    request = front_door.scripted.calls_to("Complete")[-1].request
    assert request.options.model == MODEL
    assert request.options.temperature == pytest.approx(0.3)
    assert request.options.top_p == pytest.approx(0.9)
    assert request.options.seed == 42
    assert list(request.options.stop) == ["\n\n", "END"]
    assert request.options.max_tokens == 7
    assert [m.role for m in request.messages] == [chat_pb2.ROLE_SYSTEM, chat_pb2.ROLE_USER]
    assert request.messages[1].content == "parts !tokens 1 1"


def test_unset_options_stay_unset(front_door: ScriptedFrontDoor, sdk: openai.OpenAI):
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "!tokens 1 1"}])
    options = front_door.scripted.calls_to("Complete")[-1].request.options
    assert not options.HasField("temperature") and not options.HasField("seed") and options.max_tokens == 0


def test_sdk_sees_typed_errors(front_door: ScriptedFrontDoor, sdk: openai.OpenAI):
    with (
        front_door.scripted.failing(
            "Complete", grpc.StatusCode.RESOURCE_EXHAUSTED, "budget spent", retry_after_s=3
        ),
        pytest.raises(openai.RateLimitError) as limited,
    ):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert limited.value.response.headers["retry-after"] == "3"
    assert "budget spent" in str(limited.value)
    bad = openai.OpenAI(base_url=f"{front_door.url}/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2**32}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ],
    ids=[
        "role",
        "tool-result-without-its-call",
        "n",
        "no-messages",
        "content-type",
        "part-type",
        "max-tokens-past-uint32",
        "temperature",
    ],
)
def test_validation_errors_are_openais_400_invalid_request_error_with_param(
    front_door: ScriptedFrontDoor, sdk: openai.OpenAI, body: dict, param: str
):
    before = len(front_door.scripted.calls_to("Complete"))
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, **body)
    assert refused.value.status_code == 400
    assert refused.value.type == "invalid_request_error" and refused.value.param == param
    assert param in refused.value.message
    assert len(front_door.scripted.calls_to("Complete")) == before


def test_the_sdk_raises_its_own_class_for_each_refusal(front_door: ScriptedFrontDoor, user: str):
    def client(token: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{front_door.url}/v1", api_key=token, max_retries=0)

    keys = front_door.envoy.keys
    with pytest.raises(openai.AuthenticationError) as expired:
        client(keys.mint(user, "pro", ttl_s=-60)).models.list()
    assert expired.value.status_code == 401
    with pytest.raises(openai.PermissionDeniedError) as elsewhere:
        client(keys.mint(user, "pro", audience="another-service")).models.list()
    assert elsewhere.value.status_code == 403
    with pytest.raises(openai.NotFoundError) as missing:
        client(keys.mint(user, "pro")).models.retrieve("no-such-model")
    assert missing.value.type == "not_found_error"
    with (
        front_door.scripted.failing("Complete", grpc.StatusCode.NOT_FOUND, "model x not found"),
        pytest.raises(openai.NotFoundError),
    ):
        client(keys.mint(user, "pro")).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )


def test_error_mid_stream_raises_in_the_sdk(sdk: openai.OpenAI):
    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "!runerror UNAVAILABLE 2"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError, match="scripted UNAVAILABLE"):
        for chunk in stream:
            received.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == scripted_text(2)


def test_a_refusal_before_the_first_token_is_a_429_with_retry_after_not_an_error_chunk(sdk: openai.OpenAI):
    # The router refuses a request its engine dropped from the queue at its TTFT objective after
    # `started`: the edge holds the response's status until the answer's first event, so an OpenAI
    # client gets the 429 (its SDK retries those) instead of a 200 whose stream then fails.
    with pytest.raises(openai.RateLimitError) as limited:
        stream = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "!runerror RESOURCE_EXHAUSTED 0"}], stream=True
        )
        list(stream)
    assert limited.value.status_code == 429
    assert limited.value.response.headers["retry-after"] == "2"
    assert "scripted RESOURCE_EXHAUSTED" in str(limited.value)


def test_non_streaming_run_error_becomes_an_http_error(sdk: openai.OpenAI):
    with pytest.raises(openai.InternalServerError) as failure:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "!runerror UNAVAILABLE 1"}]
        )
    assert failure.value.status_code == 503


def test_a_complete_refused_unavailable_before_its_first_event_is_sent_again(
    front_door: ScriptedFrontDoor, sdk: openai.OpenAI
):
    # A replica that drains refuses new answers UNAVAILABLE while its completion link still carries
    # others: nothing of the refused one started, so the edge sends it again on a new stream, which
    # may reach another replica; the client sees the answer.
    calls = len(front_door.scripted.calls_to("Complete"))
    refusal = {"retry_after_s": 0.5, "times": START_ATTEMPTS - 1}
    with front_door.scripted.failing("Complete", grpc.StatusCode.UNAVAILABLE, "shutting down", **refusal):
        chunks = list(
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "!tokens 3 1"}], stream=True
            )
        )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == scripted_text(3)
    assert len(front_door.scripted.calls_to("Complete")) == calls + START_ATTEMPTS
    # That many times only: the last refusal is the client's, a 503 to retry later.
    refusing = front_door.scripted.failing(
        "Complete", grpc.StatusCode.UNAVAILABLE, "shutting down", retry_after_s=0.5
    )
    with refusing, pytest.raises(openai.InternalServerError) as failure:
        list(
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "!tokens 3 1"}], stream=True
            )
        )
    assert failure.value.status_code == 503 and failure.value.response.headers["retry-after"] == "1"
    assert len(front_door.scripted.calls_to("Complete")) == calls + 2 * START_ATTEMPTS


def test_a_refusal_other_than_unavailable_is_not_sent_again(
    front_door: ScriptedFrontDoor, sdk: openai.OpenAI
):
    calls = len(front_door.scripted.calls_to("Complete"))
    refusing = front_door.scripted.failing(
        "Complete", grpc.StatusCode.RESOURCE_EXHAUSTED, "budget", retry_after_s=9
    )
    with refusing, pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert len(front_door.scripted.calls_to("Complete")) == calls + 1


def test_formats_and_tools_reach_the_chat_service_as_one_constraint(
    front_door: ScriptedFrontDoor, sdk: openai.OpenAI
):
    def sent(**body: object) -> chat_pb2.CompleteRequest:
        sdk.chat.completions.create(model=MODEL, max_tokens=2, **body)  # type: ignore[call-overload]
        return front_door.scripted.calls_to("Complete")[-1].request

    question = [{"role": "user", "content": "!tokens 1 1"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert (
        json.loads(sent(messages=question, response_format=json_schema).options.structured.json_schema)
        == schema
    )
    assert sent(messages=question, response_format={"type": "json_object"}).options.structured.json_object
    assert not sent(messages=question, response_format={"type": "text"}).options.HasField("structured")
    choice = sent(messages=question, extra_body={"structured_outputs": {"choice": ["x", "y"]}})
    assert list(choice.options.structured.choice.choices) == ["x", "y"]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    history = [
        {"role": "system", "content": "Be brief."},
        *question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "09:41"},
    ]
    called = sent(messages=history, tools=[tool], tool_choice="required")
    assert (
        "<tool_call>" in called.options.structured.grammar
        and '"const": "get_time"' in called.options.structured.grammar
    )
    system, _, assistant, result = called.messages
    assert system.content.startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in system.content
    assert assistant.content == '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert result.role == chat_pb2.ROLE_USER and result.content == "<tool_response>\n09:41\n</tool_response>"
    assert not sent(messages=question, tools=[tool], tool_choice="none").options.HasField("structured")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "response_format": {"type": "json_object"},
            },
            "tools",
        ),
    ],
    ids=[
        "tool-choice-without-tools",
        "parallel-without-tools",
        "schema-missing",
        "two-constraints",
        "tools-and-format",
    ],
)
def test_inconsistent_structured_output_and_tool_settings_are_400s_naming_the_parameter(
    front_door: ScriptedFrontDoor, sdk: openai.OpenAI, body: dict, param: str
):
    before = len(front_door.scripted.calls_to("Complete"))
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body=body)
    assert refused.value.param == param, refused.value.body
    assert len(front_door.scripted.calls_to("Complete")) == before
