"""OpenAI-compatible API: ``POST /v1/chat/completions`` (-> ChatService.Complete) and ``GET /v1/models``.

Works with the official ``openai`` SDK unmodified (``base_url=<envoy>/v1``, ``api_key=<JWT>``): streaming
``data:`` chunks ending in ``data: [DONE]``, ``stream_options.include_usage``, finish reasons, usage with
cached prompt tokens, and errors in OpenAI's error-object shape. Structured outputs (``response_format``,
``structured_outputs``) and tools (``tools``, ``tool_choice``, ``tool_calls`` in answers and history):
edge.structured_outputs and edge.tools. ``n`` choices, one run each: edge.choices.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tool_format import ToolCall, ToolCallParser, Tools, parse_answer, result_text
from edge.bodies import read_json, validate_model
from edge.chat_client.run_stream import RunStream
from edge.chats_api import caller_of
from edge.choices import ChoiceEvent, Choices
from edge.client_gone import unless_client_leaves
from edge.convert import FINISH_REASONS, logprobs_json, options_proto
from edge.errors import ApiError, from_run_error
from edge.openai_fields import without_no_ops
from edge.schemas import ChatCompletionIn, ChatMessageIn, CompletionIn, stop_list
from edge.sse import E, Events, Item, TextEvent, compact_json, relay, sse_response
from edge.structured_outputs import refused_constraint, response_format_proto
from edge.tools import calls_text, tools_for, with_tools_described

ROLES = {
    "system": chat_pb2.ROLE_SYSTEM,
    "developer": chat_pb2.ROLE_SYSTEM,
    "user": chat_pb2.ROLE_USER,
    "assistant": chat_pb2.ROLE_ASSISTANT,
}


def openai_finish_reason(reason: chat_pb2.FinishReason, called_tools: bool = False) -> str:
    # OpenAI has no "cancelled": a stopped answer simply ended.
    name = FINISH_REASONS.get(reason) or "stop"
    if name == "stop" and called_tools:
        return "tool_calls"
    return name if name in ("stop", "length", "content_filter") else "stop"


def calls_seed(completion_id: str, index: int) -> str:
    """What choice ``index``'s tool call ids derive from: the completion's id, and the choice's after
    the first (no two choices' calls share an id)."""
    return f"{completion_id}-{index}" if index else completion_id


def restarting() -> ApiError:
    """What a stream the edge drains ends with: OpenAI clients cannot resume a stream, so they are told
    to retry rather than see it end silently."""
    return ApiError(503, "the server is restarting; retry the request", type="server_error", code="draining")


def openai_usage(usage: chat_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def prompt_message(message: ChatMessageIn) -> chat_pb2.PromptMessage:
    """A message of the body as the model reads it: tool calls and results in edge.tools' format."""
    if message.role == "tool":
        return chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content=result_text(message.text()))
    parts = [message.text(), calls_text(message.tool_calls or [])]
    return chat_pb2.PromptMessage(role=ROLES[message.role], content="\n".join(p for p in parts if p))


def answer_tools(body: ChatCompletionIn) -> Tools | None:
    """The tools the answer may call (None: a plain answer); 400 naming the parameter at fault."""
    try:
        tools = tools_for(body.functions(), body.tool_choice, body.parallel_tool_calls)
    except ValueError as exc:
        param = "tool_choice" if body.tool_choice is not None else "parallel_tool_calls"
        raise ApiError(400, str(exc), code="invalid_value", param=param) from None
    if tools is not None and body.logprobs:
        raise ApiError(400, "logprobs cannot be combined with tools here", param="logprobs")
    if tools is not None and (body.response_format or body.structured_outputs):
        raise ApiError(
            400, "tools cannot be combined with response_format or structured_outputs here", param="tools"
        )
    if body.response_format and body.response_format.type != "text" and body.structured_outputs:
        raise ApiError(
            400, "give response_format or structured_outputs, not both", param="structured_outputs"
        )
    return tools


def sampling_options(body: ChatCompletionIn | CompletionIn, max_tokens: int) -> chat_pb2.GenerationOptions:
    """The sampling fields both OpenAI completion routes share, as GenerationOptions."""
    options = options_proto(
        model=body.model,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=stop_list(body.stop),
    )
    options.presence_penalty = body.presence_penalty or 0.0
    options.frequency_penalty = body.frequency_penalty or 0.0
    options.min_p = body.min_p or 0.0
    options.logit_bias.update({int(token): bias for token, bias in (body.logit_bias or {}).items()})
    return options


def complete_request(body: ChatCompletionIn, tools: Tools | None) -> chat_pb2.CompleteRequest:
    messages = [prompt_message(m) for m in body.messages]
    options = sampling_options(body, body.max_completion_tokens or body.max_tokens or 0)
    options.logprobs = bool(body.logprobs)
    options.top_logprobs = body.top_logprobs or 0
    if tools is not None:
        messages = with_tools_described(messages, tools)
        options.structured.CopyFrom(tools.constraint())
    elif body.structured_outputs is not None:
        options.structured.CopyFrom(body.structured_outputs.proto())
    elif (structured := response_format_proto(body.response_format)) is not None:
        options.structured.CopyFrom(structured)
    return chat_pb2.CompleteRequest(messages=messages, options=options, merge_deltas=True)


def constraint_param(body: ChatCompletionIn) -> str:
    """The body's field a constraint the engine refused came from."""
    if body.tools:
        return "tools"
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def openai_names(error: ApiError) -> ApiError:
    """``error`` naming the body's field as OpenAI's API does: CompleteRequest nests the sampling fields
    in ``options``, OpenAI's body has them at the top (``options.max_tokens`` is ``max_tokens``)."""
    if error.param:
        error.param = error.param.removeprefix("options.")
    return error


class ChunkWriter:
    """Turns one choice's run events into ``chat.completion.chunk`` objects (a tool call as one delta
    when its ``</tool_call>`` arrives). ``usage_last``: its run's usage is the stream's last chunk (one
    choice); with several, ``ChoiceWriters`` sends their sum."""

    def __init__(
        self,
        completion_id: str,
        model: str,
        include_usage: bool,
        tools: Tools | None,
        logprobs: bool = False,
        index: int = 0,
        usage_last: bool = True,
    ) -> None:
        self.calls = ToolCallParser(calls_seed(completion_id, index)) if tools is not None else None
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.index = index
        self.usage_last = usage_last
        self.usage: chat_pb2.Usage | None = None
        self._content = TextEvent(lambda text: self.chunk({"content": text}))  # a delta's chunk

    def chunk(
        self, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None
    ) -> ServerSentEvent:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {**self.base, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None  # as OpenAI does: present and null on every chunk but the last
        return _data(body)

    def events(self, event: chat_pb2.RunEvent) -> list[Item]:
        kind = event.WhichOneof("kind")
        if kind == "started":
            return [self.chunk({"role": "assistant", "content": ""})]
        if kind == "delta":
            if self.calls is not None:  # logprobs are refused with tools
                text, calls = self.calls.feed(event.delta.text)
                return self._tool_deltas(text, calls)
            if self.logprobs:  # the rare stream that asked for them: the slow, general encoding
                content = {"content": logprobs_json(event.delta.logprobs), "refusal": None}
                return [self.chunk({"content": event.delta.text}, logprobs=content)]
            return [self._content(event.delta.text)]
        if kind == "usage":
            self.usage = event.usage
            return []
        if kind == "done":
            out = self._tool_deltas(self.calls.rest(), []) if self.calls is not None else []
            called = bool(self.calls and self.calls.calls)
            out.append(self.chunk({}, openai_finish_reason(event.done.finish_reason, called)))
            if self.include_usage and self.usage_last:
                out.append(self.usage_chunk(self.usage or chat_pb2.Usage()))
            return out
        if kind == "error":
            e = event.error
            return self.error(from_run_error(e.code, e.message, e.retry_after_ms))
        return []

    def usage_chunk(self, usage: chat_pb2.Usage) -> ServerSentEvent:
        return _data({**self.base, "choices": [], "usage": openai_usage(usage)})

    def _tool_deltas(self, text: str, calls: list[ToolCall]) -> list[Item]:
        out: list[Item] = [self._content(text)] if text else []
        assert self.calls is not None
        first = len(self.calls.calls) - len(calls)
        out += [self.chunk({"tool_calls": [call.chat_json(first + i)]}) for i, call in enumerate(calls)]
        return out

    @staticmethod
    def error(error: ApiError) -> list[Item]:
        # The SDK raises openai.APIError for a chunk holding "error".
        return [_data(error.body())]


class ChoiceWriters:
    """The chunks of ``n`` choices: each choice's own ChunkWriter (its index in every chunk), then one
    usage chunk, summed as OpenAI sums it, and ``[DONE]``."""

    def __init__(self, writers: list[ChunkWriter]) -> None:
        self.writers = writers

    def events(self, item: ChoiceEvent) -> list[Item]:
        return self.writers[item.index].events(item.event)

    def closing(self) -> list[Item]:
        out: list[Item] = []
        if self.writers[0].include_usage:
            out.append(self.writers[0].usage_chunk(choices_usage([w.usage for w in self.writers])))
        return [*out, ServerSentEvent(data="[DONE]")]


def choices_usage(usages: Sequence[chat_pb2.Usage | None]) -> chat_pb2.Usage:
    """The usage of a request's choices as OpenAI counts it: the prompt once (the first choice's, which
    computed it), the completions summed."""
    first = usages[0] or chat_pb2.Usage()
    return chat_pb2.Usage(
        prompt_tokens=first.prompt_tokens,
        cached_prompt_tokens=first.cached_prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages if u is not None),
    )


def _data(body: dict) -> ServerSentEvent:
    return ServerSentEvent(data=compact_json(body))


def openai_stream(
    request: Request,
    stream: Events[E],
    first: E,
    started: float,
    to_sse: Callable[[E], Sequence[Item]],
    on_error: Callable[[ApiError], Sequence[Item]],
    closing: Callable[[], Sequence[Item]] = lambda: [ServerSentEvent(data="[DONE]")],
) -> Response:
    """An OpenAI route's SSE response: the run's events as ``to_sse`` writes them, then ``closing``
    (``data: [DONE]``); a stream the edge drains ends with an error telling the client to retry."""
    events = relay(
        stream,
        first,
        "openai",
        started,
        request.app.state.drain,
        to_sse,
        on_error,
        closing=closing,
        drained=lambda: on_error(restarting()),
    )
    return sse_response(events, request.app.state.settings.streams)


async def chat_completions(request: Request) -> Response:
    started = time.monotonic()
    orchestrator, settings = request.app.state.orchestrator, request.app.state.settings
    caller = caller_of(request)
    body = validate_model(
        ChatCompletionIn, without_no_ops(ChatCompletionIn, await read_json(request, settings.max_body_bytes))
    )
    tools = answer_tools(body)
    if body.n is not None and body.n > 1:
        return await _choices_response(request, body, tools, started)
    stream = orchestrator.stream("Complete", complete_request(body, tools), caller)
    try:
        first = await stream.opening_answer()
    except ApiError as error:
        raise refused_constraint(openai_names(error), constraint_param(body)) from None
    run = first.started if first.WhichOneof("kind") == "started" else chat_pb2.RunStarted()
    completion_id = f"chatcmpl-{run.run_id or int(started * 1e6)}"
    model = run.model or body.model
    if body.stream:
        writer = ChunkWriter(
            completion_id,
            model,
            bool(body.stream_options and body.stream_options.include_usage),
            tools,
            logprobs=bool(body.logprobs),
        )
        return openai_stream(request, stream, first, started, writer.events, writer.error)
    return JSONResponse(
        await unless_client_leaves(
            request, _collect(stream, first, completion_id, model, tools, bool(body.logprobs))
        )
    )


async def _choices_response(
    request: Request, body: ChatCompletionIn, tools: Tools | None, started: float
) -> Response:
    """A completion of ``body.n`` choices (edge.choices), streamed or whole."""
    orchestrator = request.app.state.orchestrator
    n = body.n or 1
    try:
        choices = await Choices.open(orchestrator, complete_request(body, tools), caller_of(request), n)
    except ApiError as error:
        raise refused_constraint(openai_names(error), constraint_param(body)) from None
    first = choices.openings[0]
    run = first.started if first.WhichOneof("kind") == "started" else chat_pb2.RunStarted()
    completion_id = f"chatcmpl-{run.run_id or int(started * 1e6)}"
    model = run.model or body.model
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writers = ChoiceWriters(
            [
                ChunkWriter(
                    completion_id, model, include_usage, tools, bool(body.logprobs), i, usage_last=False
                )
                for i in range(n)
            ]
        )
        return openai_stream(
            request, choices, choices.first(), started, writers.events, ChunkWriter.error, writers.closing
        )

    async def collected() -> dict:
        try:
            answers = await asyncio.gather(
                *(
                    _choice(stream, opening, completion_id, tools, bool(body.logprobs), i)
                    for i, (stream, opening) in enumerate(zip(choices.streams, choices.openings, strict=True))
                )
            )
        finally:
            choices.detach()
        return _completion(
            completion_id, model, [a for a, _ in answers], choices_usage([u for _, u in answers])
        )

    return JSONResponse(await unless_client_leaves(request, collected()))


async def _collect(
    stream: RunStream,
    first: chat_pb2.RunEvent,
    completion_id: str,
    model: str,
    tools: Tools | None,
    logprobs: bool,
) -> dict:
    """A non-streamed completion: the whole answer, or the HTTP error its run ended with."""
    choice, usage = await _choice(stream, first, completion_id, tools, logprobs, 0)
    return _completion(completion_id, model, [choice], usage)


def _completion(completion_id: str, model: str, choices: list[dict], usage: chat_pb2.Usage) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": openai_usage(usage),
    }


@dataclass
class Answer:
    """A non-streamed answer, gathered from its run's events."""

    text: str
    logprobs: list[chat_pb2.TokenLogprob]
    usage: chat_pb2.Usage
    finish: chat_pb2.FinishReason


async def gathered(stream: RunStream, first: chat_pb2.RunEvent) -> Answer:
    """The whole answer of ``stream``, or the HTTP error its run ended with."""
    text: list[str] = []
    token_logprobs: list[chat_pb2.TokenLogprob] = []
    usage, finish = chat_pb2.Usage(), chat_pb2.FINISH_REASON_STOP
    async with aclosing(stream.events(first)) as events:
        async for event in events:
            kind = event.WhichOneof("kind")
            if kind == "delta":
                text.append(event.delta.text)
                token_logprobs += event.delta.logprobs
            elif kind == "usage":
                usage = event.usage
            elif kind == "done":
                finish = event.done.finish_reason
            elif kind == "error":
                raise from_run_error(event.error.code, event.error.message, event.error.retry_after_ms)
    return Answer("".join(text), token_logprobs, usage, finish)


async def _choice(
    stream: RunStream,
    first: chat_pb2.RunEvent,
    completion_id: str,
    tools: Tools | None,
    logprobs: bool,
    index: int,
) -> tuple[dict, chat_pb2.Usage]:
    """One choice of a non-streamed completion and its run's usage, or the HTTP error its run ended
    with."""
    answer = await gathered(stream, first)
    message: dict = {"role": "assistant", "content": answer.text, "refusal": None}
    calls: list[ToolCall] = []
    if tools is not None:
        message["content"], calls = parse_answer(message["content"], calls_seed(completion_id, index))
        if calls:
            message["tool_calls"] = [call.chat_json() for call in calls]
    choice = {
        "index": index,
        "message": message,
        "logprobs": {"content": logprobs_json(answer.logprobs), "refusal": None} if logprobs else None,
        "finish_reason": openai_finish_reason(answer.finish, bool(calls)),
    }
    return choice, answer.usage


def model_json(model: chat_pb2.Model) -> dict:
    return {
        "id": model.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "chatmesh",
        "context_length": model.context_length,
        "engines": model.engines,
        # Beside OpenAI's fields: what the model takes (chat: /v1/chat/completions and chats;
        # completion: /v1/completions only) and the licence of its weights.
        "kind": model.kind,
        "licence": model.licence,
    }


async def list_models(request: Request) -> JSONResponse:
    reply = await request.app.state.orchestrator.unary(
        "ListModels", chat_pb2.ListModelsRequest(), caller_of(request)
    )
    return JSONResponse({"object": "list", "data": [model_json(m) for m in reply.models]})


async def get_model(request: Request) -> JSONResponse:
    model_id = request.path_params["model_id"]
    reply = await request.app.state.orchestrator.unary(
        "ListModels", chat_pb2.ListModelsRequest(), caller_of(request)
    )
    for model in reply.models:
        if model.model_id == model_id:
            return JSONResponse(model_json(model))
    raise ApiError(404, f"model {model_id!r} not found", type="not_found_error", code="model_not_found")


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
]
