"""OpenAI's Conversations API over stored chats (works with the ``openai`` SDK's ``client.conversations``).

POST   /v1/conversations                        CreateChat (metadata), then AppendMessages (items)
GET    /v1/conversations/{id}                   GetChat
POST   /v1/conversations/{id}                   SetChatMetadata
DELETE /v1/conversations/{id}                   DeleteChat
POST   /v1/conversations/{id}/items             AppendMessages
GET    /v1/conversations/{id}/items             GetBranch (the branch at the newest message), paged here
GET    /v1/conversations/{id}/items/{item_id}   the same branch, one item of it
DELETE /v1/conversations/{id}/items/{item_id}   DeleteMessage

A conversation is a chat and an item a message (edge.conversation_items), so a conversation is one of
the caller's chats (another user's is a 404, as a chat is), a response created with ``conversation``
continues it (edge.responses_api), and the chat page shows it. Deleting an item takes its message out of
the chat's tree (DeleteMessage: its replies follow its parent).
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatmesh.chat.v1 import chat_pb2
from edge import responses_api
from edge.bodies import read_json, validate_model
from edge.chat_client.caller import Caller
from edge.chat_client.client import ChatClient
from edge.chats_api import caller_of
from edge.conversation_items import (
    MAX_NEW_ITEMS,
    append,
    branch,
    chat_id_of,
    check_items_query,
    conversation_json,
    conversation_not_found,
    item_json,
    items_page,
    list_json,
    message_id_of,
    prompt_messages,
)
from edge.errors import ApiError
from edge.openai_fields import check_query
from edge.strict import Strict

# Conversations name a bad parameter to the item and field (``items[2].role``).
openai_errors = functools.partial(responses_api.openai_errors, naming=None)


class ConversationCreateIn(Strict):
    items: list[Any] | None = Field(None, max_length=MAX_NEW_ITEMS)
    metadata: dict[str, str] | None = None


class ConversationUpdateIn(Strict):
    metadata: dict[str, str]


class ItemsCreateIn(Strict):
    items: list[Any] = Field(min_length=1, max_length=MAX_NEW_ITEMS)


async def _chat(request: Request) -> tuple[ChatClient, Caller, chat_pb2.Chat]:
    """The caller's conversation the path names (404 if it is not theirs or not a conversation id)."""
    orchestrator = request.app.state.orchestrator
    value = request.path_params["conversation_id"]
    chat_id = chat_id_of(value)
    caller = caller_of(request, chat_id)
    try:
        reply = await orchestrator.unary("GetChat", chat_pb2.GetChatRequest(chat_id=chat_id), caller)
    except ApiError as exc:
        if exc.status == 404:
            raise conversation_not_found(value) from None
        raise
    return orchestrator, caller, reply.chat


async def _body(request: Request) -> dict:
    return await read_json(request, request.app.state.settings.max_body_bytes)


@openai_errors
async def create_conversation(request: Request) -> Response:
    check_query(request.query_params)
    body = validate_model(ConversationCreateIn, await _body(request))
    messages = prompt_messages(body.items or [])
    orchestrator, caller = request.app.state.orchestrator, caller_of(request)
    create = chat_pb2.CreateChatRequest(metadata=body.metadata or {})
    chat = (await orchestrator.unary("CreateChat", create, caller)).chat
    if messages:
        routed = caller.for_chat(chat.chat_id)
        try:
            await append(orchestrator, routed, chat.chat_id, messages)
        except ApiError:
            # Refused (an item too long, moderated): no half-made conversation is left behind.
            await orchestrator.unary("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat.chat_id), routed)
            raise
    return JSONResponse(conversation_json(chat))


@openai_errors
async def retrieve_conversation(request: Request) -> Response:
    check_query(request.query_params)
    _, _, chat = await _chat(request)
    return JSONResponse(conversation_json(chat))


@openai_errors
async def update_conversation(request: Request) -> Response:
    check_query(request.query_params)
    body = validate_model(ConversationUpdateIn, await _body(request))
    orchestrator, caller, chat = await _chat(request)
    update = chat_pb2.SetChatMetadataRequest(chat_id=chat.chat_id, metadata=body.metadata)
    chat = (await orchestrator.unary("SetChatMetadata", update, caller)).chat
    return JSONResponse(conversation_json(chat))


@openai_errors
async def delete_conversation(request: Request) -> Response:
    check_query(request.query_params)
    orchestrator, caller, chat = await _chat(request)
    await orchestrator.unary("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat.chat_id), caller)
    value = request.path_params["conversation_id"]
    return JSONResponse({"id": value, "object": "conversation.deleted", "deleted": True})


@openai_errors
async def create_items(request: Request) -> Response:
    check_items_query(request)
    body = validate_model(ItemsCreateIn, await _body(request))
    messages = prompt_messages(body.items)
    orchestrator, caller, chat = await _chat(request)
    stored = await append(orchestrator, caller, chat.chat_id, messages)
    return JSONResponse(list_json([item_json(m) for m in stored], has_more=False))


@openai_errors
async def list_items(request: Request) -> Response:
    check_items_query(request, ("after", "limit", "order"))
    orchestrator, caller, chat = await _chat(request)
    messages = await branch(orchestrator, caller, chat.chat_id)
    return JSONResponse(items_page([item_json(m) for m in messages], request))


@openai_errors
async def retrieve_item(request: Request) -> Response:
    check_items_query(request)
    orchestrator, caller, chat = await _chat(request)
    value = request.path_params["item_id"]
    message_id = message_id_of(value)
    for message in await branch(orchestrator, caller, chat.chat_id) if message_id else []:
        if message.message_id == message_id:
            return JSONResponse(item_json(message))
    raise ApiError(404, f"item {value!r} not found", code="not_found")


@openai_errors
async def delete_item(request: Request) -> Response:
    check_query(request.query_params)
    orchestrator, caller, chat = await _chat(request)
    value = request.path_params["item_id"]
    message_id = message_id_of(value)
    try:
        if message_id is None:
            raise ApiError(404, "not one of ours")
        delete = chat_pb2.DeleteMessageRequest(chat_id=chat.chat_id, message_id=message_id)
        await orchestrator.unary("DeleteMessage", delete, caller)
    except ApiError as exc:
        if exc.status == 404:
            raise ApiError(404, f"item {value!r} not found", code="not_found") from None
        raise
    return JSONResponse(conversation_json(chat))


routes = [
    Route("/v1/conversations", create_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", retrieve_conversation, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}", update_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", create_items, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"]),
]
