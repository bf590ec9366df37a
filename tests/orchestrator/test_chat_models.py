"""A chat records its model, through real processes: two pools of null engines (SmolLM2's tokenizer under
two names), a router placing by model, an orchestrator with one ``--model-file`` per pool, Cassandra.
A chat created for a model is answered by it; a send naming the other model switches the chat; a model
not served creates nothing; a model's own budget (``--model-budget``) is kept apart from the tier's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tokenizer import load_tokenizer
from tests.fixtures.orchestrator import ChatClient, Mesh, MeshFactory, collect

# The pro tier's budget for the second model: a window's usage of a few short answers.
OTHER_PRO_BUDGET = 150


@dataclass(frozen=True)
class TwoChatModels:
    mesh: Mesh
    primary: str
    other: str


@pytest.fixture(scope="module")
def two_chat_models(start_mesh: MeshFactory) -> TwoChatModels:
    other = f"{load_tokenizer().model_name}-other"
    models = TwoChatModels(
        *start_mesh.twin_pools(titles=False, model_budget=[f"{other}:pro={OTHER_PRO_BUDGET}"])
    )
    assert models.other == other
    return models


@pytest.fixture
def user(two_chat_models: TwoChatModels, connect: Callable[..., ChatClient]) -> ChatClient:
    return connect(two_chat_models.mesh.orchestrator.address)


async def test_models_are_listed_with_kind_and_licence(
    two_chat_models: TwoChatModels, user: ChatClient
) -> None:
    models = (await user.call("ListModels", chat_pb2.ListModelsRequest())).models
    assert [(m.model_id, m.kind, m.licence) for m in models] == [
        (two_chat_models.primary, "chat", "Apache-2.0"),
        (two_chat_models.other, "chat", "Apache-2.0"),
    ]


async def test_a_chat_is_answered_by_its_model_until_a_send_switches_it(
    two_chat_models: TwoChatModels, user: ChatClient
) -> None:
    primary, other = two_chat_models.primary, two_chat_models.other
    created = await user.call("CreateChat", chat_pb2.CreateChatRequest(model=other))
    chat_id = created.chat.chat_id
    assert created.chat.model == other
    run = await collect(user.send(chat_id, "hi", options=chat_pb2.GenerationOptions(max_tokens=2)))
    assert run[0].started.model == other
    # Naming the other model answers with it and switches the chat: the next send naming none follows.
    run = await collect(
        user.send(chat_id, "again", options=chat_pb2.GenerationOptions(model=primary, max_tokens=2))
    )
    assert run[0].started.model == primary
    assert (await user.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat_id))).chat.model == primary
    run = await collect(user.send(chat_id, "and again", options=chat_pb2.GenerationOptions(max_tokens=2)))
    assert run[0].started.model == primary
    # A chat created naming none stays on the default model (recorded as none).
    plain = (await user.call("CreateChat", chat_pb2.CreateChatRequest())).chat
    assert plain.model == ""
    run = await collect(user.send(plain.chat_id, "hi", options=chat_pb2.GenerationOptions(max_tokens=2)))
    assert run[0].started.model == primary


async def test_a_chat_for_a_model_not_served_is_not_created(user: ChatClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await user.call("CreateChat", chat_pb2.CreateChatRequest(title="lost", model="no-such-model"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in (caught.value.details() or "")
    assert list((await user.call("ListChats", chat_pb2.ListChatsRequest())).chats) == []


async def test_a_model_of_its_own_budget_is_refused_once_the_window_reaches_it_and_the_others_are_not(
    two_chat_models: TwoChatModels, user: ChatClient
) -> None:
    primary, other = two_chat_models.primary, two_chat_models.other
    chats = [(await user.create_chat()).chat_id for _ in range(3)]
    spent = await collect(
        user.send(chats[0], "hi", options=chat_pb2.GenerationOptions(model=primary, max_tokens=60))
    )
    used = spent[-2].usage.prompt_tokens + spent[-2].usage.completion_tokens
    assert 60 < used < OTHER_PRO_BUDGET  # within the pro tier's budget and the other model's
    # The window's usage is every model's: the other model's ceiling has no room for prompt + 100 more.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(
            user.send(chats[1], "hi", options=chat_pb2.GenerationOptions(model=other, max_tokens=100))
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"of {OTHER_PRO_BUDGET} (the pro tier's budget for {other})" in (caught.value.details() or "")
    # The first model has the tier's budget (2,000,000 a day): still answered.
    run = await collect(
        user.send(chats[2], "hi", options=chat_pb2.GenerationOptions(model=primary, max_tokens=100))
    )
    assert run[0].started.model == primary and run[-1].HasField("done")
    refused = await two_chat_models.mesh.orchestrator.counted(
        "chatmesh_orchestrator_budget_rejections", tier="pro", limit="tokens", gen_ai_request_model=other
    )
    assert refused == 1
