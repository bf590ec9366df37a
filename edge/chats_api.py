"""The chat page's REST + SSE API; every handler is one ChatService call.

GET    /v1/me                                          who the caller's bearer token says they are
GET    /v1/usage                                       GetUsage
GET    /v1/chats?page_size&page_token                  ListChats (newest activity first)
GET    /v1/search?q&page_size&page_token               SearchChats (newest chat first)
POST   /v1/chats                                       CreateChat                     -> 201
GET    /v1/chats/{chat_id}                             GetChat
PATCH  /v1/chats/{chat_id}                             RenameChat
DELETE /v1/chats/{chat_id}                             DeleteChat                     -> 204
GET    /v1/chats/{chat_id}/messages?page_size&page_token   ListMessages (newest first)
GET    /v1/chats/{chat_id}/branch?page_size&page_token     GetBranch from the newest message (leaf first)
GET    /v1/chats/{chat_id}/messages/{id}/branch?page_size&page_token&newest_leaf   GetBranch from message id
POST   /v1/chats/{chat_id}/messages                    SendMessage        -> text/event-stream
                                                       (content, or tool_results for a message's calls)
POST   /v1/chats/{chat_id}/messages/{id}/regenerate    RegenerateMessage  -> text/event-stream
GET    /v1/runs/{run_id}                               GetRun
GET    /v1/runs/{run_id}/events   (Last-Event-ID)      StreamRun(after_seq)  -> text/event-stream
POST   /v1/runs/{run_id}/cancel                        CancelRun

Each event stream asks for merged deltas: when the stream is behind its run, the deltas waiting come
as one event (its ``id:`` the last one's sequence number, so ``Last-Event-ID`` still resumes exactly).
"""

from __future__ import annotations

import re
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatmesh.chat.v1 import chat_pb2
from chatmesh.identity import AUTHORIZATION_HEADER, CHAT_ID_HEADER, TokenVerifier, Unauthenticated
from edge.bodies import read_model
from edge.chat_client.caller import Caller
from edge.chat_client.client import ChatClient
from edge.convert import (
    chat_json,
    message_json,
    options_proto,
    run_json,
    search_hit_json,
    timestamp,
    versions_json,
)
from edge.errors import ApiError
from edge.params import unsigned
from edge.schemas import API, UINT64_MAX, CreateChatIn, RegenerateIn, RenameChatIn, SendMessageIn
from edge.settings import EdgeSettings
from edge.sse import run_events_response

# Ids are server-chosen and URL-safe; anything else cannot name a chat, so it is refused without a call.
_ID = re.compile(rf"^[A-Za-z0-9_.:-]{{1,{API.max_id_chars}}}$")


def caller_of(request: Request, chat_id: str = "") -> Caller:
    """The caller as their bearer token proves them (Envoy checked it too; the edge trusts no header it
    cannot verify, since anyone who reaches the edge directly could set one). No valid token: 401."""
    verifier: TokenVerifier = request.app.state.verifier
    authorization = request.headers.get(AUTHORIZATION_HEADER, "")
    try:
        identity = verifier.identity(authorization)
    except Unauthenticated as exc:
        raise ApiError(401, str(exc), type="authentication_error", code="unauthenticated") from exc
    return Caller(identity=identity, authorization=authorization, chat_id=chat_id)


def path_id(request: Request, name: str, what: str) -> str:
    value = request.path_params[name]
    if not _ID.match(value):
        raise ApiError(404, f"{what} {value!r} not found", type="not_found_error", code="not_found")
    return value


def page_args(request: Request, max_size: int) -> tuple[int, str]:
    size = unsigned(request.query_params.get("page_size", "0"), "page_size", max_size)
    token = request.query_params.get("page_token", "")
    if len(token) > 1024:
        raise ApiError(400, "page_token is too long", code="invalid_value", param="page_token")
    return size, token


def _app(request: Request) -> tuple[ChatClient, EdgeSettings]:
    return request.app.state.orchestrator, request.app.state.settings


async def me(request: Request) -> JSONResponse:
    caller = caller_of(request)
    return JSONResponse({"user_id": caller.identity.user_id, "tier": caller.identity.tier})


async def usage(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    reply = await orchestrator.unary("GetUsage", chat_pb2.GetUsageRequest(), caller_of(request))
    return JSONResponse(
        {
            "tier": reply.tier,
            "used_tokens": reply.used_tokens,
            "limit_tokens": reply.limit_tokens,
            "window_start_time": timestamp(reply.window_start_time),
            "window_end_time": timestamp(reply.window_end_time),
        }
    )


async def list_chats(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    caller = caller_of(request)
    size, token = page_args(request, API.max_chat_page)
    reply = await orchestrator.unary(
        "ListChats", chat_pb2.ListChatsRequest(page_size=size, page_token=token), caller
    )
    return JSONResponse(
        {"chats": [chat_json(c) for c in reply.chats], "next_page_token": reply.next_page_token or None}
    )


async def search_chats(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    caller = caller_of(request)
    size, token = page_args(request, API.max_search_page)
    query = request.query_params.get("q", "")
    if not query.strip() or len(query) > API.max_search_query_chars:
        raise ApiError(
            422, f"q must have 1..{API.max_search_query_chars} characters", code="invalid_value", param="q"
        )
    reply = await orchestrator.unary(
        "SearchChats", chat_pb2.SearchChatsRequest(query=query, page_size=size, page_token=token), caller
    )
    return JSONResponse(
        {"hits": [search_hit_json(h) for h in reply.hits], "next_page_token": reply.next_page_token or None}
    )


async def create_chat(request: Request) -> JSONResponse:
    orchestrator, settings = _app(request)
    caller = caller_of(request)
    body = await read_model(request, CreateChatIn, settings.max_body_bytes)
    create = chat_pb2.CreateChatRequest(
        title=body.title, idempotency_key=idempotency_key_of(request), model=body.model
    )
    reply = await orchestrator.unary("CreateChat", create, caller)
    return JSONResponse(chat_json(reply.chat), status_code=201)


async def get_chat(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    reply = await orchestrator.unary(
        "GetChat", chat_pb2.GetChatRequest(chat_id=chat_id), caller_of(request, chat_id)
    )
    return JSONResponse(chat_json(reply.chat))


async def rename_chat(request: Request) -> JSONResponse:
    orchestrator, settings = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    caller = caller_of(request, chat_id)
    body = await read_model(request, RenameChatIn, settings.max_body_bytes)
    reply = await orchestrator.unary(
        "RenameChat", chat_pb2.RenameChatRequest(chat_id=chat_id, title=body.title), caller
    )
    return JSONResponse(chat_json(reply.chat))


async def delete_chat(request: Request) -> Response:
    orchestrator, _ = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    await orchestrator.unary(
        "DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat_id), caller_of(request, chat_id)
    )
    return Response(status_code=204)


async def list_messages(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    caller = caller_of(request, chat_id)
    size, token = page_args(request, API.max_message_page)
    reply = await orchestrator.unary(
        "ListMessages",
        chat_pb2.ListMessagesRequest(chat_id=chat_id, page_size=size, page_token=token),
        caller,
    )
    return _messages_page(reply)


def _messages_page(reply: chat_pb2.ListMessagesResponse) -> JSONResponse:
    return JSONResponse(
        {
            "messages": [message_json(m) for m in reply.messages],
            "next_page_token": reply.next_page_token or None,
        }
    )


async def get_branch(request: Request) -> JSONResponse:
    """A page of the path ending at the message in the URL (or at the chat's newest; ``newest_leaf=true``:
    at the newest message under the one in the URL), leaf first, each message with its versions."""
    orchestrator, _ = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    leaf = path_id(request, "message_id", "message") if "message_id" in request.path_params else ""
    size, token = page_args(request, API.max_message_page)
    newest = request.query_params.get("newest_leaf", "false")
    if newest not in ("true", "false") or (newest == "true" and not leaf):
        raise ApiError(
            400,
            "newest_leaf must be true or false, and true only on a message's branch",
            code="invalid_value",
            param="newest_leaf",
        )
    reply = await orchestrator.unary(
        "GetBranch",
        chat_pb2.GetBranchRequest(
            chat_id=chat_id,
            leaf_message_id=leaf,
            page_size=size,
            page_token=token,
            newest_leaf=newest == "true",
        ),
        caller_of(request, chat_id),
    )
    # An orchestrator older than versions sends none (a rolling upgrade): each is then not known.
    versions = list(reply.versions)
    if len(versions) != len(reply.messages):
        versions = [chat_pb2.Versions()] * len(reply.messages)
    messages = [
        {**message_json(m), "versions": versions_json(v)}
        for m, v in zip(reply.messages, versions, strict=True)
    ]
    return JSONResponse({"messages": messages, "next_page_token": reply.next_page_token or None})


def idempotency_key_of(request: Request, from_body: str = "") -> str:
    """The request's idempotency key: the body's, else the Idempotency-Key header's (may be empty)."""
    key = from_body or request.headers.get("idempotency-key", "")
    if len(key) > API.max_idempotency_key_chars:
        raise ApiError(
            400,
            f"Idempotency-Key is longer than {API.max_idempotency_key_chars} characters",
            code="invalid_value",
            param="Idempotency-Key",
        )
    return key


async def send_message(request: Request) -> Response:
    started = time.monotonic()
    orchestrator, settings = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    caller = caller_of(request, chat_id)
    # The message's size limit is the orchestrator's to check (its flag sets it): a refusal is a 413.
    body = await read_model(request, SendMessageIn, settings.max_body_bytes)
    stream = orchestrator.stream(
        "SendMessage",
        chat_pb2.SendMessageRequest(
            chat_id=chat_id,
            content=body.content,
            tool_results=[
                chat_pb2.ToolResult(tool_call_id=r.tool_call_id, content=r.content) for r in body.tool_results
            ],
            parent_message_id=body.parent_message_id,
            idempotency_key=idempotency_key_of(request, body.idempotency_key),
            options=options_proto(body.options),
            merge_deltas=True,
        ),
        caller,
    )
    return await run_events_response(stream, settings.streams, request.app.state.drain, started)


async def regenerate(request: Request) -> Response:
    started = time.monotonic()
    orchestrator, settings = _app(request)
    chat_id = path_id(request, "chat_id", "chat")
    message_id = path_id(request, "message_id", "message")
    caller = caller_of(request, chat_id)
    body = await read_model(request, RegenerateIn, settings.max_body_bytes)
    stream = orchestrator.stream(
        "RegenerateMessage",
        chat_pb2.RegenerateMessageRequest(
            chat_id=chat_id,
            message_id=message_id,
            idempotency_key=idempotency_key_of(request, body.idempotency_key),
            options=options_proto(body.options),
            merge_deltas=True,
        ),
        caller,
    )
    return await run_events_response(stream, settings.streams, request.app.state.drain, started)


def _run_caller(request: Request) -> Caller:
    # Runs belong to a chat; the page names it so Envoy's ring hash finds the replica running it.
    chat_id = request.headers.get(CHAT_ID_HEADER) or request.query_params.get("chat_id", "")
    return caller_of(request, chat_id if _ID.match(chat_id or "") else "")


def _after_seq(request: Request) -> int:
    header = request.headers.get("last-event-id", "")
    param, raw = (
        ("Last-Event-ID", header) if header else ("after_seq", request.query_params.get("after_seq", "0"))
    )
    return unsigned(raw, param, UINT64_MAX, code="invalid_last_event_id")


async def get_run(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    run_id = path_id(request, "run_id", "run")
    reply = await orchestrator.unary("GetRun", chat_pb2.GetRunRequest(run_id=run_id), _run_caller(request))
    return JSONResponse(run_json(reply.run))


async def run_events(request: Request) -> Response:
    started = time.monotonic()
    orchestrator, settings = _app(request)
    run_id = path_id(request, "run_id", "run")
    caller = _run_caller(request)
    stream = orchestrator.stream(
        "StreamRun",
        chat_pb2.StreamRunRequest(run_id=run_id, after_seq=_after_seq(request), merge_deltas=True),
        caller,
    )
    return await run_events_response(stream, settings.streams, request.app.state.drain, started)


async def cancel_run(request: Request) -> JSONResponse:
    orchestrator, _ = _app(request)
    run_id = path_id(request, "run_id", "run")
    reply = await orchestrator.unary(
        "CancelRun", chat_pb2.CancelRunRequest(run_id=run_id), _run_caller(request)
    )
    return JSONResponse(run_json(reply.run))


routes = [
    Route("/v1/me", me, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
    Route("/v1/chats", list_chats, methods=["GET"]),
    Route("/v1/chats", create_chat, methods=["POST"]),
    Route("/v1/search", search_chats, methods=["GET"]),
    Route("/v1/chats/{chat_id}", get_chat, methods=["GET"]),
    Route("/v1/chats/{chat_id}", rename_chat, methods=["PATCH"]),
    Route("/v1/chats/{chat_id}", delete_chat, methods=["DELETE"]),
    Route("/v1/chats/{chat_id}/messages", list_messages, methods=["GET"]),
    Route("/v1/chats/{chat_id}/messages", send_message, methods=["POST"]),
    Route("/v1/chats/{chat_id}/branch", get_branch, methods=["GET"]),
    Route("/v1/chats/{chat_id}/messages/{message_id}/branch", get_branch, methods=["GET"]),
    Route("/v1/chats/{chat_id}/messages/{message_id}/regenerate", regenerate, methods=["POST"]),
    Route("/v1/runs/{run_id}", get_run, methods=["GET"]),
    Route("/v1/runs/{run_id}/events", run_events, methods=["GET"]),
    Route("/v1/runs/{run_id}/cancel", cancel_run, methods=["POST"]),
]
