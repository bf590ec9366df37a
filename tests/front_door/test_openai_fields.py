"""Which OpenAI fields the edge accepts, through the real Envoy and edge (answered by ScriptedChatService).

Every body in tests/data/openai_requests/ (what the official SDKs and common frameworks send) is
accepted; a field chatmesh does not know, or a known one at a value it does not serve, is OpenAI's 400
``invalid_request_error`` naming it, and nothing reaches the chat service.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import openai
import pytest

from edge.openai_fields import without_no_ops
from edge.schemas import ChatMessageIn, Strict
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.scripted_chat_service import MODEL

CORPUS = sorted((Path(__file__).parents[1] / "data" / "openai_requests").glob("*.json"))
# The chat service each route calls, for an unstored and a stored request.
_CALLED = {"/v1/chat/completions": "Complete", "/v1/responses": "SendMessage"}


def _calls(front_door: ScriptedFrontDoor) -> int:
    return sum(len(front_door.scripted.calls_to(method)) for method in ("Complete", "SendMessage"))


def test_the_corpus_covers_each_client_and_route():
    cases = [json.loads(path.read_text()) for path in CORPUS]
    clients = {case["client"].split(" ")[0] for case in cases}
    assert {
        "openai-python",
        "openai-node",
        "langchain-openai",
        "llama-index-llms-openai",
        "LiteLLM",
    } <= clients
    assert any(client.startswith("Vercel") for client in clients)
    assert {case["path"] for case in cases} == set(_CALLED)
    assert len(cases) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=[path.stem for path in CORPUS])
def test_what_real_clients_send_is_accepted(front_door: ScriptedFrontDoor, user: str, path: Path):
    case = json.loads(path.read_text())
    body = {**case["body"], "model": MODEL}
    method = "Complete" if body.get("store") is False else _CALLED[case["path"]]
    before = len(front_door.scripted.calls_to(method))
    with front_door.client(user) as client:
        reply = client.post(case["path"], json=body)
    assert reply.status_code == 200, reply.text
    if body.get("stream"):
        events = [line for line in reply.text.splitlines() if line.startswith("data:")]
        payloads = [json.loads(line[5:]) for line in events[:-1]]
        assert events and not any(
            p.get("error") or p.get("type") in ("error", "response.failed") for p in payloads
        )
        last = events[-1]
        assert (
            last == "data: [DONE]" if case["path"] == "/v1/chat/completions" else "response.completed" in last
        )
    else:
        answer = reply.json()
        assert answer.get("status", "completed") == "completed" and answer.get("error") is None
    assert len(front_door.scripted.calls_to(method)) == before + 1


def _refused(front_door: ScriptedFrontDoor, user: str, route: str, body: dict) -> dict:
    """The OpenAI error a request to ``route`` with ``body`` (over the route's defaults) gets: a 400
    answered before any call reached the orchestrator."""
    before = _calls(front_door)
    path, defaults = _route(route)
    with front_door.client(user) as client:
        reply = client.post(path, json={**defaults, **body})
    assert reply.status_code == 400, reply.text
    assert _calls(front_door) == before
    return reply.json()["error"]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {"frequency_penalties": 0.5}, "frequency_penalties"),
        ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
        ("chat", {"": 1}, '""'),
        ("chat", {"stream_options": {"include_usage": True, "chunk_size": 2}}, "stream_options.chunk_size"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]},
            "messages[0].cache_control",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "detail": "low"}]}]},
            "messages[0].content[0].detail",
        ),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strictly": True}}]},
            "tools[0].function.strictly",
        ),
        ("responses", {"input": "hi", "temprature": 0.2}, "temprature"),
    ],
    ids=[
        "top-level",
        "vllm-extension",
        "empty-name",
        "stream-options",
        "message",
        "text-part",
        "tool",
        "responses",
    ],
)
def test_unknown_fields_are_refused_naming_them(
    front_door: ScriptedFrontDoor, user: str, route: str, body: dict, param: str
):
    error = _refused(front_door, user, route, body)
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_parameter"
    assert error["param"] == param and error["message"] == f"Unrecognized request argument supplied: {param}"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("chat", {"function_call": {"name": "f"}}, "function_call"),
        ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("chat", {"store": True}, "store"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
        (
            "chat",
            {
                "messages": [
                    {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": ""}}
                ]
            },
            "messages[0].function_call",
        ),
        ("responses", {"input": "hi", "max_tool_calls": 2}, "max_tool_calls"),
        ("responses", {"input": "hi", "top_logprobs": 3}, "top_logprobs"),
        (
            "responses",
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": "x"}
                ]
            },
            "input",  # the Responses API names a body's top-level field
        ),
        ("responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ("responses", {"input": "hi", "truncation": "auto"}, "truncation"),
    ],
    ids=[
        "functions",
        "function-call",
        "prediction",
        "store",
        "audio",
        "reasoning-effort",
        "history-function-call",
        "responses-max-tool-calls",
        "responses-top-logprobs",
        "responses-function-call-item-status",
        "responses-reasoning",
        "responses-truncation",
    ],
)
def test_values_chatmesh_does_not_serve_are_refused_naming_the_field(
    front_door: ScriptedFrontDoor, user: str, route: str, body: dict, param: str
):
    error = _refused(front_door, user, route, body)
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_value"
    assert error["param"] == param and "not supported" in error["message"]


@pytest.mark.parametrize("n", [0, True, 9, 2.5], ids=["zero", "true", "over-the-cap", "fraction"])
def test_a_choice_count_out_of_range_is_refused_naming_n(front_door: ScriptedFrontDoor, user: str, n: object):
    error = _refused(front_door, user, "chat", {"n": n})
    assert error["type"] == "invalid_request_error" and error["param"] == "n"


def test_responses_refuse_n(front_door: ScriptedFrontDoor, user: str):
    # Several answers to one Response are not an OpenAI feature: the field is unknown there.
    error = _refused(front_door, user, "responses", {"input": "hi", "n": 2})
    assert error["code"] == "unknown_parameter" and error["param"] == "n"


def test_no_op_values_pass_through_the_sdk(front_door: ScriptedFrontDoor, user: str):
    sdk = front_door.sdk(user)
    completion = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "!tokens 2 1", "name": "alice"}],
        n=1,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        store=False,
        user="end-user-7",
        metadata={"app": "test"},
        service_tier="auto",
        stream_options=None,
        extra_body={"function_call": "none", "verbosity": "medium"},
    )
    assert completion.choices[0].finish_reason == "stop"
    response = sdk.responses.create(
        model=MODEL,
        input="!tokens 2 1",
        tools=[],
        tool_choice="auto",
        text={"format": {"type": "text"}},
        include=[],
        truncation="disabled",
        user="end-user-7",
    )
    assert response.status == "completed"
    chunks = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "!tokens 2 1"}],
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert [chunk.usage.completion_tokens for chunk in chunks if chunk.usage] == [2]


def test_the_sdk_raises_bad_request_for_an_unserved_value(front_door: ScriptedFrontDoor, user: str):
    with pytest.raises(openai.BadRequestError) as refused:
        front_door.sdk(user).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
        )
    assert refused.value.param == "reasoning_effort" and refused.value.code == "unsupported_value"


def _route(route: str) -> tuple[str, dict]:
    if route == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return "/v1/responses", {"model": MODEL}


def test_retrieving_a_response_refuses_query_parameters_it_does_not_serve(
    front_door: ScriptedFrontDoor, user: str
):
    with front_door.client(user) as client:
        created = client.post("/v1/responses", json={"model": MODEL, "input": "!tokens 2 1"}).json()
        path = f"/v1/responses/{created['id']}"
        assert client.get(path, params={"include_obfuscation": "false"}).status_code == 200
        for params, param, code in [
            ({"include[]": "message.output_text.logprobs"}, "include[]", "unsupported_value"),
            ({"starting_afterr": "3"}, "starting_afterr", "unknown_parameter"),
        ]:
            reply = client.get(path, params=params)
            assert reply.status_code == 400, reply.text
            assert (reply.json()["error"]["param"], reply.json()["error"]["code"]) == (param, code)
        reply = client.post(f"{path}/cancel", params={"force": "true"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "force"


class _FunctionCall(Strict):
    type: Literal["function_call"]
    name: str


class _Items(Strict):
    input: list[_FunctionCall | ChatMessageIn]


def test_each_item_of_a_union_is_read_as_the_member_its_type_names():
    body = {
        "input": [
            {"type": "function_call", "name": "f"},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "user", "content": "hi"},
        ]
    }
    assert without_no_ops(_Items, body) == {
        "input": [{"type": "function_call", "name": "f"}, {"role": "user", "content": "hi"}]
    }
