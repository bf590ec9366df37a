"""The official ``openai`` SDK, unmodified, against the OpenAI-compatible API through the real Envoy and
edge, answered by ScriptedChatService (not the orchestrator)."""

from __future__ import annotations

import grpc
import openai
import pytest

from chatmesh.chat.v1 import chat_pb2
from tests.front_door.conftest import FrontDoor
from tests.front_door.scripted_chat_service import MODEL, scripted_text


@pytest.fixture
def sdk(front_door: FrontDoor, user: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front_door.url}/v1", api_key=front_door.envoy.token(user), max_retries=0)


def test_non_streaming_completion(sdk: openai.OpenAI):
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say something !tokens 5 1"},
        ],
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == scripted_text(5)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5


def test_streaming_completion_with_usage(sdk: openai.OpenAI):
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream it !tokens 8 10"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == scripted_text(8)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_usage_has_no_usage_chunk(sdk: openai.OpenAI):
    chunks = list(
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "!tokens 2 1"}], stream=True
        )
    )
    assert all(c.choices for c in chunks)


def test_max_tokens_ends_with_length(sdk: openai.OpenAI):
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "long !tokens 50 1"}], max_tokens=3
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3


def test_sampling_options_reach_the_chat_service(front_door: FrontDoor, sdk: openai.OpenAI):
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


def test_unset_options_stay_unset(front_door: FrontDoor, sdk: openai.OpenAI):
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "!tokens 1 1"}])
    options = front_door.scripted.calls_to("Complete")[-1].request.options
    assert not options.HasField("temperature") and not options.HasField("seed") and options.max_tokens == 0


def test_models_list_and_retrieve(sdk: openai.OpenAI):
    models = sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_sdk_sees_typed_errors(front_door: FrontDoor, sdk: openai.OpenAI):
    with (
        front_door.scripted.failing(
            "Complete", grpc.StatusCode.RESOURCE_EXHAUSTED, "budget spent", retry_after_s=3
        ),
        pytest.raises(openai.RateLimitError) as limited,
    ):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert limited.value.response.headers["retry-after"] == "3"
    assert "budget spent" in str(limited.value)
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.UnprocessableEntityError):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    bad = openai.OpenAI(base_url=f"{front_door.url}/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_error_mid_stream_raises_in_the_sdk(sdk: openai.OpenAI):
    stream = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "!runerror UNAVAILABLE 2"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError, match="scripted UNAVAILABLE"):
        for chunk in stream:
            received.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in received if c.choices) == scripted_text(2)


def test_non_streaming_run_error_becomes_an_http_error(sdk: openai.OpenAI):
    with pytest.raises(openai.InternalServerError) as failure:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "!runerror UNAVAILABLE 1"}]
        )
    assert failure.value.status_code == 503
