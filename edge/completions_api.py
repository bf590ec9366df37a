"""OpenAI's legacy completions route, ``POST /v1/completions`` (-> ChatService.Complete with ``prompt``):
a prompt string continued as it is, with no chat template, streamed or not; nothing stored but usage.

It is the only route a completion model (a base model such as Gemma 3 270M) takes; chat models take it
too, as vLLM and llama.cpp's server serve it. One prompt and one choice per request; ``logprobs`` in
this route's own shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatmesh.chat.v1 import chat_pb2
from edge.bodies import read_json, validate_model
from edge.chats_api import caller_of
from edge.client_gone import unless_client_leaves
from edge.errors import ApiError, from_run_error
from edge.openai_api import (
    gathered,
    openai_finish_reason,
    openai_names,
    openai_stream,
    openai_usage,
    sampling_options,
)
from edge.openai_fields import without_no_ops
from edge.schemas import CompletionIn
from edge.sse import Item, TextEvent, compact_json


def completion_request(body: CompletionIn) -> chat_pb2.CompleteRequest:
    options = sampling_options(body, body.max_tokens)
    options.logprobs = body.logprobs is not None
    options.top_logprobs = body.logprobs or 0
    return chat_pb2.CompleteRequest(prompt=body.prompt, options=options, merge_deltas=True)


class TextLogprobs:
    """This route's ``logprobs`` object, its ``text_offset`` counted on across a stream's chunks."""

    def __init__(self, top: bool) -> None:
        self.top = top
        self.offset = 0

    def json(self, logprobs: Sequence[chat_pb2.TokenLogprob]) -> dict:
        tokens = [_text(lp.token_bytes) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_text(t.token_bytes): t.logprob for t in lp.top} for lp in logprobs]
            if self.top
            else None,
            "text_offset": offsets,
        }


def _text(token_bytes: bytes) -> str:
    # A token holding part of a UTF-8 character has no text of its own.
    return token_bytes.decode("utf-8", errors="backslashreplace")


class TextChunkWriter:
    """Turns run events into ``text_completion`` chunks, as OpenAI streams this route."""

    def __init__(self, completion_id: str, model: str, include_usage: bool, logprobs: TextLogprobs | None):
        self.base = {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.usage = chat_pb2.Usage()
        self._text = TextEvent(lambda text: self.chunk(text))

    def chunk(
        self, text: str, finish_reason: str | None = None, logprobs: dict | None = None
    ) -> ServerSentEvent:
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {**self.base, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None  # present and null on every chunk but the last
        return ServerSentEvent(data=compact_json(body))

    def events(self, event: chat_pb2.RunEvent) -> list[Item]:
        kind = event.WhichOneof("kind")
        if kind == "delta":
            if self.logprobs is not None:
                return [self.chunk(event.delta.text, logprobs=self.logprobs.json(event.delta.logprobs))]
            return [self._text(event.delta.text)]
        if kind == "usage":
            self.usage = event.usage
            return []
        if kind == "done":
            out: list[Item] = [self.chunk("", openai_finish_reason(event.done.finish_reason))]
            if self.include_usage:
                body = {**self.base, "choices": [], "usage": openai_usage(self.usage)}
                out.append(ServerSentEvent(data=compact_json(body)))
            return out
        if kind == "error":
            return self.error(
                from_run_error(event.error.code, event.error.message, event.error.retry_after_ms)
            )
        return []

    @staticmethod
    def error(error: ApiError) -> list[Item]:
        return [ServerSentEvent(data=compact_json(error.body()))]


async def completions(request: Request) -> Response:
    started = time.monotonic()
    orchestrator, settings = request.app.state.orchestrator, request.app.state.settings
    body = validate_model(
        CompletionIn, without_no_ops(CompletionIn, await read_json(request, settings.max_body_bytes))
    )
    stream = orchestrator.stream("Complete", completion_request(body), caller_of(request))
    try:
        first = await stream.opening_answer()
    except ApiError as error:
        raise openai_names(error) from None
    run = first.started if first.WhichOneof("kind") == "started" else chat_pb2.RunStarted()
    completion_id = f"cmpl-{run.run_id or int(started * 1e6)}"
    model = run.model or body.model
    logprobs = TextLogprobs(bool(body.logprobs)) if body.logprobs is not None else None
    if body.stream:
        writer = TextChunkWriter(
            completion_id, model, bool(body.stream_options and body.stream_options.include_usage), logprobs
        )
        return openai_stream(request, stream, first, started, writer.events, writer.error)
    answer = await unless_client_leaves(request, gathered(stream, first))
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "text": answer.text,
                    "index": 0,
                    "logprobs": logprobs.json(answer.logprobs) if logprobs is not None else None,
                    "finish_reason": openai_finish_reason(answer.finish),
                }
            ],
            "usage": openai_usage(answer.usage),
        }
    )


routes = [Route("/v1/completions", completions, methods=["POST"])]
