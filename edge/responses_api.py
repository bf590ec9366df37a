"""OpenAI's Responses API, backed by the orchestrator's durable runs (works with the ``openai`` SDK).

POST   /v1/responses                      store (default): a new chat's first message, or, with
                                          previous_response_id, the message after that response's
                                          answer in its chat: SendMessage. store=false: Complete.
GET    /v1/responses/{id}                 GetRun, then the run's events (StreamRun) folded into the object
GET    /v1/responses/{id}?stream=true&starting_after=N   StreamRun: the stream events after N
POST   /v1/responses/{id}/cancel          CancelRun
DELETE /v1/responses/{id}                 DeleteChat: the conversation the response belongs to

Structured output (``text.format``) and function calling (``tools``, ``tool_choice``,
``function_call`` output items, ``function_call`` / ``function_call_output`` input items) work as in
Chat Completions (edge.structured_outputs, edge.tools); a stored response's input may be the outputs of
the calls its previous response made. Streamed, a call is its function_call item's events
(edge.response_events).

A stored response *is* a run of a chat (``resp_<run id>``), so it lives in Cassandra, not in an edge or
orchestrator process: any replica retrieves it, resumes its stream or cancels it, also after the replica
that generated it is gone. A conversation chained with previous_response_id is one chat whose message
tree holds each turn (two responses continuing the same one are sibling branches).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import REFUSED_BEFORE_ANSWER
from chatmesh.tool_format import Tools
from edge.bodies import read_json, validate_model
from edge.chat_client.caller import Caller
from edge.chat_client.client import ChatClient
from edge.chat_client.run_stream import RunStream
from edge.chats_api import caller_of, idempotency_key_of
from edge.client_gone import unless_client_leaves
from edge.conversation_items import (
    append,
    chat_id_of,
    check_items_query,
    conversation_not_found,
    item_json,
    items_page,
)
from edge.convert import options_proto
from edge.errors import ApiError
from edge.openai_api import prompt_message
from edge.openai_fields import RETRIEVE_QUERY_NO_OPS, check_query, without_no_ops
from edge.params import unsigned
from edge.response_events import ResponseEvents
from edge.response_record import ResponseRecord, response_not_found, run_id_of
from edge.schemas import ResponseCreateIn
from edge.sse import relay, sse_response
from edge.structured_outputs import refused_constraint, text_format_proto
from edge.tools import tools_for, with_tools_described

# The orchestrator's field names for what the Responses API calls otherwise.
_PARAMS = {
    "content": "input",
    "messages": "input",
    "tool_results": "input",
    "options.model": "model",
    "options.max_tokens": "max_output_tokens",
    "options.temperature": "temperature",
    "options.top_p": "top_p",
}
# Chats made for responses are titled from their first input, so no title job runs for them.
_TITLE_CHARS = 80


def _responses_param(param: str) -> str:
    """A field as the Responses API names it: its own name, the top-level field ("tools[0].type" is
    "tools"; a query's "include[]" stays)."""
    return (
        _PARAMS.get(param) or _PARAMS.get(param.split("[")[0]) or re.sub(r"\[\d+\]$", "", param.split(".")[0])
    )


def openai_errors(
    handler: Callable[[Request], Awaitable[Response]],
    naming: Callable[[str], str] | None = _responses_param,
) -> Callable[[Request], Awaitable[Response]]:
    """OpenAI answers a bad parameter with 400 invalid_request_error naming the parameter (the page's
    API says 422): the same errors, the parameter named by ``naming`` (None: as it is)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            if exc.status == 422:
                exc.status = 400
            if exc.param is not None and naming is not None:
                exc.param = naming(exc.param)
            raise

    return wrapped


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def _tools(body: ResponseCreateIn) -> Tools | None:
    """The tools the answer may call (None: a plain answer)."""
    try:
        tools = tools_for(list(body.tools), body.tool_choice, body.parallel_tool_calls)
    except ValueError as exc:
        raise _bad(
            "tool_choice" if body.tool_choice is not None else "parallel_tool_calls", str(exc)
        ) from None
    if tools is not None and text_format_proto(body.text) is not None:
        raise _bad("tools", "tools cannot be combined with a text.format other than text here")
    return tools


def _options(body: ResponseCreateIn, tools: Tools | None) -> chat_pb2.GenerationOptions:
    options = options_proto(
        model=body.model,
        max_tokens=body.max_output_tokens or 0,
        temperature=body.temperature,
        top_p=body.top_p,
    )
    structured = tools.constraint() if tools is not None else text_format_proto(body.text)
    if structured is not None:
        options.structured.CopyFrom(structured)
    return options


def _complete_request(body: ResponseCreateIn, tools: Tools | None) -> chat_pb2.CompleteRequest:
    if body.conversation is not None:
        raise _bad("conversation", "a response in a conversation is stored (store: true)")
    if body.previous_response_id:
        raise _bad("previous_response_id", "previous_response_id needs a stored response (store: true)")
    if body.background:
        raise _bad("background", "background responses must be stored (store: true)")
    system = (
        [chat_pb2.PromptMessage(role=chat_pb2.ROLE_SYSTEM, content=body.instructions)]
        if body.instructions
        else []
    )
    messages = system + [prompt_message(m) for m in body.messages()]
    if tools is not None:
        messages = with_tools_described(messages, tools)
    return chat_pb2.CompleteRequest(messages=messages, options=_options(body, tools))


def _stored_input(body: ResponseCreateIn) -> tuple[str, list[chat_pb2.ToolResult]]:
    """What a stored response adds to its chat: one user message, or the outputs of the calls its
    previous response made (tool messages, one per output); earlier turns are the chat's own."""
    messages = body.messages()
    if len(messages) == 1 and messages[0].role == "user":
        return messages[0].text(), []
    if messages and body.previous_response_id and all(m.role == "tool" for m in messages):
        return "", [chat_pb2.ToolResult(tool_call_id=m.tool_call_id, content=m.text()) for m in messages]
    raise _bad(
        "input",
        "a stored response takes one user message, or function_call_output items, as input (earlier "
        "turns come from previous_response_id); send a whole conversation with store: false",
    )


def _tool_choice_json(tools: Tools | None, offered: bool) -> str | dict:
    if tools is None:
        return "none" if offered else "auto"
    if tools.choice in ("auto", "required"):
        return tools.choice
    return {"type": "function", "name": tools.choice}


def _instructions(body: ResponseCreateIn, tools: Tools | None) -> str:
    parts = [body.instructions or "", tools.system_text() if tools is not None else ""]
    return "\n\n".join(part for part in parts if part)


async def _stored_run(request: Request) -> tuple[ChatClient, Caller, chat_pb2.Run]:
    """The run the response id in the path names (404 if it is not the caller's, was not stored, or its
    conversation was deleted), and the caller routed to the replica that holds it, if it lives."""
    orchestrator = request.app.state.orchestrator
    caller = caller_of(request)
    run = await _owned_run(orchestrator, caller, request.path_params["response_id"], None)
    return orchestrator, caller.for_chat(run.chat_id), run


async def _owned_run(orchestrator: ChatClient, caller: Caller, value: str, param: str | None) -> chat_pb2.Run:
    run_id = run_id_of(value, param)
    try:
        run = (await orchestrator.unary("GetRun", chat_pb2.GetRunRequest(run_id=run_id), caller)).run
        if not run.chat_id:  # a live store=false response: never retrievable
            raise response_not_found(value, param)
        await orchestrator.unary("GetChat", chat_pb2.GetChatRequest(chat_id=run.chat_id), caller)
    except ApiError as exc:
        if exc.status == 404:
            raise response_not_found(value, param) from None
        raise
    return run


async def _delete_quietly(orchestrator: ChatClient, routed: Caller, chat_id: str) -> None:
    with contextlib.suppress(ApiError):
        await orchestrator.unary("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat_id), routed)


async def _send(
    orchestrator: ChatClient, caller: Caller, body: ResponseCreateIn, tools: Tools | None, key: str
) -> tuple[RunStream, chat_pb2.RunEvent]:
    """The stored response's stream and first event (see ``_opening``). With ``key`` (the
    Idempotency-Key) a retry creates no second conversation (CreateChat with the key gets the first
    one's) and joins the run the first attempt started, or answers the same question anew if that run
    was refused before its answer."""
    previous, conversation = body.previous_response_id, body.conversation_id
    results: list[chat_pb2.ToolResult] = []
    if conversation is not None:
        if previous:
            raise _bad("conversation", "give conversation or previous_response_id, not both")
        chat_id, content = await _in_conversation(orchestrator, caller, body, conversation)
        parent_id, keyless_chat_id = "", ""
    elif previous:
        content, results = _stored_input(body)
        run = await _owned_run(orchestrator, caller, previous, "previous_response_id")
        if run.status in (chat_pb2.RUN_STATUS_IN_PROGRESS, chat_pb2.RUN_STATUS_CANCELLING):
            raise _bad(
                "previous_response_id", f"response {previous!r} is still in progress; wait for it to end"
            )
        chat_id, parent_id, keyless_chat_id = run.chat_id, run.assistant_message_id, ""
    else:
        content, results = _stored_input(body)
        chat_id, parent_id = await _new_chat(orchestrator, caller, content, key), ""
        keyless_chat_id = "" if key else chat_id
    routed = caller.for_chat(chat_id)
    send = chat_pb2.SendMessageRequest(
        chat_id=chat_id,
        content=content,
        tool_results=results,
        parent_message_id=parent_id,
        options=_options(body, tools),
        instructions=_instructions(body, tools),
        idempotency_key=key,
    )
    stream = orchestrator.stream("SendMessage", send, routed)
    try:
        return stream, await _opening(stream, body)
    except ApiError as exc:
        # Refused: leave no conversation behind that a retry could not find again (a keyed one's retry
        # answers in it).
        if keyless_chat_id:
            await _delete_quietly(orchestrator, routed, keyless_chat_id)
        elif previous and exc.status == 404:  # its answer was never stored (cancelled before any text)
            raise response_not_found(previous, "previous_response_id") from None
        raise


async def _in_conversation(
    orchestrator: ChatClient, caller: Caller, body: ResponseCreateIn, conversation: str
) -> tuple[str, str]:
    """The chat of the caller's ``conversation`` and the user message the response answers in it (the
    input's last item); the input's items before it are added to the conversation first."""
    chat_id = chat_id_of(conversation, "conversation")
    routed = caller.for_chat(chat_id)
    try:
        await orchestrator.unary("GetChat", chat_pb2.GetChatRequest(chat_id=chat_id), routed)
    except ApiError as exc:
        if exc.status == 404:
            raise conversation_not_found(conversation, "conversation") from None
        raise
    messages = body.messages()
    for i, message in enumerate(messages):
        if message.role not in ("user", "assistant") or message.tool_calls:
            what = "function_call items" if message.role in ("tool", "assistant") else f"{message.role} items"
            raise _bad(
                "input" if isinstance(body.input, str) else f"input[{i}]",
                f"{what} are not stored in a conversation yet: message items of user or assistant only "
                "(system and developer text goes in instructions)",
            )
    if messages[-1].role != "user":
        raise _bad("input", "a response in a conversation answers a user message: the input's last item")
    earlier = [prompt_message(message) for message in messages[:-1]]
    if earlier:
        await append(orchestrator, routed, chat_id, earlier)
    return chat_id, messages[-1].text()


async def _opening(stream: RunStream, body: ResponseCreateIn) -> chat_pb2.RunEvent:
    try:
        return await _first_event(stream, body)
    except ApiError as error:
        raise refused_constraint(error, "tools" if body.tools else "text.format") from None


async def _first_event(stream: RunStream, body: ResponseCreateIn) -> chat_pb2.RunEvent:
    """The create's first event. A background create answers at its run's start. Any other, streamed or
    not, waits for the event after it: a run refused before any output (the engine's queue limit, no
    engine left) is the HTTP error to retry (429 or 503 with Retry-After), as a refusal at the door is,
    never a 200 that ends in ``response.failed``. Other failures are a failed response, as OpenAI's are."""
    if body.background:
        return await stream.opening()
    return await stream.opening_answer(raising=REFUSED_BEFORE_ANSWER)


async def _new_chat(orchestrator: ChatClient, caller: Caller, content: str, key: str) -> str:
    """The chat a new conversation is stored in, titled from its first input; with ``key``, the one
    the key's first attempt made."""
    title = " ".join(content.split())[:_TITLE_CHARS]
    create = chat_pb2.CreateChatRequest(title=title, idempotency_key=key)
    try:
        return (await orchestrator.unary("CreateChat", create, caller)).chat.chat_id
    except ApiError as exc:
        if key and exc.status == 404:
            raise ApiError(
                409,
                "the conversation this Idempotency-Key began was deleted; use a new key",
                type="conflict_error",
                code="already_exists",
                param="Idempotency-Key",
            ) from None
        raise


async def _fold(
    stream: RunStream, record: ResponseRecord, first: chat_pb2.RunEvent, until_seq: int = 0
) -> None:
    """Applies ``first`` and the events after it to ``record`` until the run ends (or, with
    ``until_seq``, until that event: the state of a run still generating)."""
    async with contextlib.aclosing(stream.events(first)) as events:
        async for event in events:
            record.apply(event)
            if record.ended or (until_seq and event.seq >= until_seq):
                return


def _stream_response(
    request: Request,
    stream: RunStream,
    first: chat_pb2.RunEvent,
    record: ResponseRecord,
    request_started: float,
    starting_after: int = -1,
) -> Response:
    writer = ResponseEvents(record, starting_after)
    events = relay(
        stream,
        first,
        "responses",
        request_started,
        request.app.state.drain,
        writer.sse,
        writer.error,
        drained=writer.drained,
    )
    return sse_response(events, request.app.state.settings.streams)


@openai_errors
async def create_response(request: Request) -> Response:
    started = time.monotonic()
    orchestrator, settings = request.app.state.orchestrator, request.app.state.settings
    caller = caller_of(request)
    body = validate_model(
        ResponseCreateIn, without_no_ops(ResponseCreateIn, await read_json(request, settings.max_body_bytes))
    )
    tools = _tools(body)
    record = ResponseRecord(
        model=body.model,
        store=body.store,
        background=body.background,
        previous_response_id=body.previous_response_id,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        text_format=body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text is not None and body.text.format is not None
        else None,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools],
        tool_choice=_tool_choice_json(tools, bool(body.tools)),
        parallel_tool_calls=tools.parallel if tools is not None else True,
    )
    if body.store:
        stream, first = await _send(orchestrator, caller, body, tools, idempotency_key_of(request))
    else:
        stream = orchestrator.stream("Complete", _complete_request(body, tools), caller)
        first = await _opening(stream, body)
    if body.stream:
        return _stream_response(request, stream, first, record, started)
    if body.background:
        # The run goes on without us (a stored run outlives its caller): retrieve or stream it later.
        record.apply(first)
        stream.detach()
        return JSONResponse(record.json())
    # A stored response goes on when its client leaves; one not stored (a Complete) is cancelled.
    await unless_client_leaves(request, _fold(stream, record, first))
    return JSONResponse(record.json())


def _query_int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    return default if raw is None else unsigned(raw, name, 2**63 - 1)


def _query_bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false"):
        raise _bad(name, f"{name} must be true or false")
    return raw == "true"


async def _response_at(orchestrator: ChatClient, caller: Caller, run: chat_pb2.Run) -> dict:
    """The response object of ``run`` as its events stand (to its end if it ended, else to its last event)."""
    stream = orchestrator.stream("StreamRun", chat_pb2.StreamRunRequest(run_id=run.run_id), caller)
    record = ResponseRecord(created_at=run.create_time.ToMicroseconds() / 1e6)
    generating = run.status == chat_pb2.RUN_STATUS_IN_PROGRESS
    await _fold(stream, record, await stream.opening(), until_seq=max(run.last_seq, 1) if generating else 0)
    return record.json()


@openai_errors
async def retrieve_response(request: Request) -> Response:
    started = time.monotonic()
    check_query(request.query_params, ("stream", "starting_after"), RETRIEVE_QUERY_NO_OPS)
    streamed, starting_after = _query_bool(request, "stream"), _query_int(request, "starting_after", -1)
    orchestrator, routed, run = await _stored_run(request)
    if not streamed:
        return JSONResponse(await _response_at(orchestrator, routed, run))
    # Every event from the first, renumbered the same way; those up to starting_after are not sent.
    stream = orchestrator.stream("StreamRun", chat_pb2.StreamRunRequest(run_id=run.run_id), routed)
    record = ResponseRecord(created_at=run.create_time.ToMicroseconds() / 1e6)
    return _stream_response(request, stream, await stream.opening(), record, started, starting_after)


@openai_errors
async def list_input_items(request: Request) -> Response:
    """The response's input: the user message its run answers (ids as a conversation's items)."""
    check_items_query(request, ("after", "limit", "order"))
    orchestrator, routed, run = await _stored_run(request)
    stream = orchestrator.stream("StreamRun", chat_pb2.StreamRunRequest(run_id=run.run_id), routed)
    try:
        started = (await stream.opening()).started
    finally:
        stream.detach()
    items = []
    if started.user_message_id:
        at = chat_pb2.GetBranchRequest(
            chat_id=run.chat_id, leaf_message_id=started.user_message_id, page_size=1
        )
        with contextlib.suppress(ApiError):  # a 404: the message was deleted from its conversation
            asked = (await orchestrator.unary("GetBranch", at, routed)).messages
            items = [item_json(message) for message in asked[:1]]
    return JSONResponse(items_page(items, request))


@openai_errors
async def cancel_response(request: Request) -> Response:
    check_query(request.query_params)
    orchestrator, routed, run = await _stored_run(request)
    # Cancelling an ended response leaves it as it is (CancelRun is a no-op then).
    reply = await orchestrator.unary("CancelRun", chat_pb2.CancelRunRequest(run_id=run.run_id), routed)
    return JSONResponse(await _response_at(orchestrator, routed, reply.run))


@openai_errors
async def delete_response(request: Request) -> Response:
    check_query(request.query_params)
    orchestrator, routed, run = await _stored_run(request)
    await orchestrator.unary("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=run.chat_id), routed)
    return JSONResponse({"id": request.path_params["response_id"], "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]
