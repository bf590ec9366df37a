"""Two models served at once through the real mesh: SmolLM2-135M-Instruct (chat) and Gemma 3 270M (a
base model: completions only), each on one real cpu engine, a router placing by model, an orchestrator
prompting each with its own tokenizer, and the front door; driven with the unmodified ``openai`` SDK,
the page's REST API and gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.model_files import bundled_model_path, gemma3_model_path
from chatmesh.tokenizer import load_tokenizer
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from tests.fixtures.cassandra import CassandraTestNode
from tests.fixtures.engines import EngineFactory
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import ChatClient, Mesh, collect
from tests.fixtures.router import router_spec, wait_for_engines

# One compute thread each: two real engines share the box with the rest of the mesh.
ENGINE_FLAGS = {"threads": 1, "kv_memory_gib": 0.1875, "max_running_requests": 4}
QUESTION = "Q: What is the capital of France?\nA:"


@dataclass(frozen=True)
class TwoModels:
    door: FrontDoor
    mesh: Mesh
    chat: str
    completion: str


@pytest.fixture(scope="module")
def two_models(
    tmp_path_factory: pytest.TempPathFactory,
    dev_jwt_keys: DevKeys,
    mesh_launcher: Launcher,
    cassandra_node: CassandraTestNode,
    start_engines: EngineFactory,
) -> Iterator[TwoModels]:
    gemma = gemma3_model_path()
    engines = [
        *start_engines(1, "cpu", **ENGINE_FLAGS),
        *start_engines(1, "cpu", model=gemma, **ENGINE_FLAGS),
    ]
    port = free_port()
    # Admission by queue length: on a busy box the wait rule's predicted first token of a slow engine
    # (Gemma runs the per-kernel loop, on one thread) can pass the TTFT objective; admission is not
    # this module's subject.
    mesh_launcher.start(router_spec("router-two-models", port, engines, admission="count"))
    wait_for_engines(f"127.0.0.1:{port}", len(engines))
    mesh = Mesh(mesh_launcher, cassandra_node, engines, f"127.0.0.1:{port}", "router-two-models")
    orchestrator = mesh.start_orchestrator(
        model_file=[str(bundled_model_path()), str(gemma)], context_window=4096
    )
    with Launcher(tmp_path_factory.mktemp("two-models-door"), echo=lambda line: None) as launcher:
        door = start_front_door(launcher, dev_jwt_keys, [orchestrator.port])
        yield TwoModels(door, mesh, load_tokenizer().model_name, load_tokenizer(str(gemma)).model_name)


@pytest.fixture
def sdk(two_models: TwoModels, user: str) -> openai.OpenAI:
    return two_models.door.sdk(user)


def test_the_models_list_shows_both_pools_with_their_kind_and_licence(
    two_models: TwoModels, sdk: openai.OpenAI
) -> None:
    listed = {model.id: model.model_dump() for model in sdk.models.list().data}
    assert set(listed) == {two_models.chat, two_models.completion}
    chat, completion = listed[two_models.chat], listed[two_models.completion]
    assert (chat["kind"], chat["licence"], chat["object"]) == ("chat", "Apache-2.0", "model")
    assert (completion["kind"], completion["licence"]) == ("completion", "Gemma Terms of Use")
    assert completion["context_length"] == 4096 and completion["engines"] == 1
    assert sdk.models.retrieve(two_models.completion).model_dump()["kind"] == "completion"


def test_a_greedy_gemma_completion_continues_as_llama_cpp_does_and_answers_paris(
    two_models: TwoModels, sdk: openai.OpenAI
) -> None:
    # A base model continues the sentence; asked as a question it answers (tests/data/gemma3_llamacpp.json:
    # llama.cpp's greedy tokens for both prompts, on the same file).
    bare = sdk.completions.create(
        model=two_models.completion, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert bare.object == "text_completion" and bare.id.startswith("cmpl-")
    assert bare.model == two_models.completion
    assert bare.choices[0].text == " the capital of the country of France."
    assert bare.choices[0].finish_reason == "length" and bare.usage.completion_tokens == 8
    # BOS, then the prompt's five tokens: Gemma's own tokenizer, not SmolLM2's.
    assert bare.usage.prompt_tokens == len(
        load_tokenizer(str(gemma3_model_path())).encode_prompt("The capital of France is")
    )
    answer = sdk.completions.create(model=two_models.completion, prompt=QUESTION, max_tokens=8, temperature=0)
    assert "Paris" in answer.choices[0].text, answer.choices[0].text


def test_a_streamed_completion_is_the_same_text_token_by_token_with_usage(
    two_models: TwoModels, sdk: openai.OpenAI
) -> None:
    whole = sdk.completions.create(model=two_models.completion, prompt=QUESTION, max_tokens=10, temperature=0)
    chunks = list(
        sdk.completions.create(
            model=two_models.completion,
            prompt=QUESTION,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert (
        chunks[-1].usage.completion_tokens == 10
        and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    )


def test_completion_logprobs_stop_and_refused_fields(two_models: TwoModels, sdk: openai.OpenAI) -> None:
    reply = sdk.completions.create(
        model=two_models.completion, prompt=QUESTION, max_tokens=12, temperature=0, logprobs=2, stop=["."]
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(logprobs.token_logprobs) >= 1
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0
    assert "." not in reply.choices[0].text and reply.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as echoed:
        sdk.completions.create(model=two_models.completion, prompt=QUESTION, max_tokens=2, echo=True)
    assert echoed.value.param == "echo" and echoed.value.code == "unsupported_value"
    with pytest.raises(openai.BadRequestError) as unknown:
        sdk.completions.create(
            model=two_models.completion, prompt=QUESTION, max_tokens=2, extra_body={"guided_choice": ["a"]}
        )
    assert unknown.value.param == "guided_choice"


def test_a_chat_on_the_completion_model_is_refused_before_anything_is_stored(
    two_models: TwoModels, sdk: openai.OpenAI, user: str
) -> None:
    with pytest.raises(openai.BadRequestError, match="completion model") as refused:
        sdk.chat.completions.create(
            model=two_models.completion, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert (refused.value.type, refused.value.param) == ("invalid_request_error", "model")
    with two_models.door.client(user) as client:
        chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
        sent = client.post(
            f"/v1/chats/{chat_id}/messages",
            json={"content": "Hi", "options": {"model": two_models.completion, "max_tokens": 4}},
        )
        assert sent.status_code == 400 and "/v1/completions" in sent.json()["error"]["message"]
        assert client.get(f"/v1/chats/{chat_id}/messages").json()["messages"] == []
        # A chat is created for a chat model, and records it; for Gemma or a model not served, none is.
        on_gemma = client.post("/v1/chats", json={"model": two_models.completion})
        assert on_gemma.status_code == 400 and on_gemma.json()["error"]["param"] == "model"
        missing = client.post("/v1/chats", json={"model": "no-such-model"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert [c["chat_id"] for c in client.get("/v1/chats").json()["chats"]] == [chat_id]
        made = client.post("/v1/chats", json={"model": two_models.chat}).json()
        assert made["model"] == two_models.chat
        assert client.get(f"/v1/chats/{made['chat_id']}").json()["model"] == two_models.chat


async def test_an_unknown_model_is_refused_404_before_anything_is_stored(
    two_models: TwoModels, sdk: openai.OpenAI, user: str
) -> None:
    for create in (
        lambda: sdk.completions.create(model="no-such-model", prompt="Hi", max_tokens=2),
        lambda: sdk.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        ),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            create()
        assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
        assert two_models.chat in str(missing.value.message)  # it names the served models
    client = ChatClient(two_models.mesh.orchestrator.address)
    try:
        chat = await client.create_chat()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(
                client.send(chat.chat_id, "Hi", options=chat_pb2.GenerationOptions(model="no-such-model"))
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as on_gemma:
            await collect(
                client.send(
                    chat.chat_id, "Hi", options=chat_pb2.GenerationOptions(model=two_models.completion)
                )
            )
        assert on_gemma.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
        assert list(page.messages) == []
    finally:
        await client.close()


def test_a_smollm2_chat_still_streams_beside_gemma(two_models: TwoModels, sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model=two_models.chat,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1
    assert "Paris" in text, text
    # A completion on the chat model: its prompt continued as it is, without the chat template.
    reply = sdk.completions.create(model=two_models.chat, prompt="The capital of France is", max_tokens=4)
    assert reply.model == two_models.chat and reply.choices[0].text
