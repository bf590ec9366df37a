"""Run events as Server-Sent Events: ``id:`` is the event's sequence number, ``event:`` its kind.

A client that loses the stream reconnects with ``Last-Event-ID: <seq>`` (GET /v1/runs/{id}/events) and
gets every later event exactly once (StreamRun(after_seq)). The first event is awaited before the
response starts, so a request the orchestrator refuses gets a real HTTP status, not a 200 with an
error inside. Keep-alive comments flow while a run is quiet. A client that disconnects only detaches;
a chat's run goes on (the orchestrator cancels an OpenAI completion, which nobody could resume).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prometheus_client import Counter
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Message, Send

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from edge.chat_client.run_stream import RunStream
from edge.convert import event_json
from edge.drain import Drain
from edge.errors import ApiError, from_service_error
from edge.observability import METRICS
from meshkit.config import setting


@dataclass(frozen=True)
class StreamSettings:
    ping_s: float = setting(
        15.0, "seconds between SSE keep-alive comments on a quiet stream", flag="sse-ping-s"
    )
    # On SIGTERM, open streams get this long to finish; then they close and clients resume elsewhere.
    drain_grace_s: float = setting(
        10.0, "seconds open streams get to finish after SIGTERM (then clients resume)"
    )
    # Tells browsers how soon to reconnect (the SSE ``retry:`` field), in milliseconds.
    retry_ms: int = 1000


def error_data(error: ApiError) -> dict:
    """A mid-stream failure, in the same shape as a RunError event."""
    return {
        "code": (error.code or "unknown").upper(),
        "message": error.message,
        "retry_after_ms": round((error.retry_after_s or 0) * 1000),
    }


# One encoder for every event's JSON: ``json.dumps`` with options builds an encoder on each call.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# What a ``TextEvent`` is rendered around once (any string would do: only the last copy is filled).
_PLACEHOLDER = "\x00text\x00"

# What the edge's streams yield to sse-starlette: an event, or one already encoded.
Item = ServerSentEvent | bytes


def compact_json(data: object) -> str:
    """``data`` as JSON without spaces, non-ASCII text as it is: every event's data."""
    return _JSON.encode(data)


class TextEvent:
    """An event sent once per token, encoded once around a placeholder for its text and then filled
    in: per token only the text is encoded, not the JSON and SSE framing around it (the dict, the
    encoder and ``ServerSentEvent.encode`` took ~23 % of the edge's main thread relaying 100 OpenAI
    streams: py-spy). ``render`` gives the event for a text (its slow form, byte for byte what this
    one sends); the text's JSON string must be the last part of it that varies."""

    def __init__(self, render: Callable[[str], ServerSentEvent]) -> None:
        whole = render(_PLACEHOLDER).encode()
        self._head, found, self._tail = whole.rpartition(compact_json(_PLACEHOLDER).encode())
        if not found:
            raise ValueError("the event does not carry its text as a JSON string")

    def __call__(self, text: str) -> bytes:
        return b"".join((self._head, compact_json(text).encode(), self._tail))


def run_event_sse(event: chat_pb2.RunEvent, retry_ms: int | None = None) -> ServerSentEvent:
    name, data = event_json(event)
    return ServerSentEvent(data=compact_json(data), event=name, id=str(event.seq), retry=retry_ms)


def delta_sse(event: chat_pb2.RunEvent) -> bytes:
    """A delta's event without ``retry``, byte for byte what ``run_event_sse`` encodes (its JSON holds no
    line break to split), without building the dict, the event and its encoding: one per token on every
    chat page's stream, ~10 µs of the edge's CPU the slow way and ~1.5 this way."""
    delta = event.delta
    data = f'{{"text":{compact_json(delta.text)},"token_count":{delta.token_count}}}'
    return f"id: {event.seq}\r\nevent: delta\r\ndata: {data}\r\n\r\n".encode()


class Event(Protocol):
    """A run's event (a RunEvent, or one choice's of several: edge.choices)."""

    def WhichOneof(self, group: str, /) -> str | None: ...


E = TypeVar("E", bound=Event)
E_co = TypeVar("E_co", bound=Event, covariant=True)


class Events(Protocol[E_co]):
    """What ``relay`` reads: a RunStream, or the merged runs of several choices (edge.choices)."""

    def rest(self) -> AsyncIterator[E_co]: ...

    def detach(self) -> None: ...


async def relay(
    stream: Events[E],
    first: E,
    kind: str,
    request_started: float,
    drain: Drain,
    to_sse: Callable[[E], Sequence[Item]],
    on_error: Callable[[ApiError], Sequence[Item]],
    closing: Callable[[], Sequence[Item]] = list,
    drained: Callable[[], Sequence[Item]] = list,
) -> AsyncIterator[Item]:
    """Relays ``first`` and the rest of ``stream`` through ``to_sse``; detaches when the client goes
    or the edge drains (the run goes on either way)."""
    METRICS.open_streams.labels(kind).inc()
    first_delta_seen = False
    # This stream's counter of each event kind, looked up once (``labels`` takes a lock and a tuple).
    counters: dict[str, Counter] = {}
    try:
        event = first
        events = stream.rest()
        with drain.watch() as draining:
            while True:
                name = event.WhichOneof("kind") or "unknown"
                if (counter := counters.get(name)) is None:
                    counter = counters[name] = METRICS.stream_events.labels(kind, name)
                counter.inc()
                if name == "delta" and not first_delta_seen:
                    first_delta_seen = True
                    METRICS.first_event.labels(kind).observe(time.monotonic() - request_started)
                for item in to_sse(event):
                    yield item
                try:
                    event = await draining.wait(anext(events))
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    # Draining: end the response cleanly (page clients resume with Last-Event-ID).
                    for item in drained():
                        yield item
                    return
        for item in closing():
            yield item
    except ServiceError as exc:
        for item in on_error(from_service_error(exc)):
            yield item
    finally:
        stream.detach()
        METRICS.open_streams.labels(kind).dec()


async def run_events_response(
    stream: RunStream, settings: StreamSettings, drain: Drain, request_started: float
) -> EventSourceResponse:
    """The page's SSE response for a run: awaits the first event (errors become HTTP statuses)."""
    first = await stream.first()
    if first is None:  # nothing after the client's Last-Event-ID: the run had ended there
        stream.detach()
        return sse_response(_nothing(), settings)
    retry_sent = False

    def to_sse(event: chat_pb2.RunEvent) -> list[Item]:
        nonlocal retry_sent
        if retry_sent and event.HasField("delta") and not event.delta.logprobs:
            return [delta_sse(event)]
        item = run_event_sse(event, None if retry_sent else settings.retry_ms)
        retry_sent = True
        return [item]

    def on_error(error: ApiError) -> list[Item]:
        # No id: the client's Last-Event-ID stays at the last event it really got.
        return [ServerSentEvent(data=compact_json(error_data(error)), event="error")]

    return sse_response(relay(stream, first, "run", request_started, drain, to_sse, on_error), settings)


async def _nothing() -> AsyncIterator[Item]:
    return
    yield  # an async generator that ends at once


class _EventStream(EventSourceResponse):
    """sse-starlette's response, each event sent without a cancel scope of its own when no send timeout
    is set (the edge sets none: the drain and Envoy's idle timeout bound a stuck client). Entering
    ``anyio.move_on_after(None)`` for every event looks up the current task, a ``getpid`` system call on
    Python 3.11, and builds a scope: ~11 % of the edge's main thread at 100 streams (py-spy). It overrides
    a private method of the pinned sse-starlette (3.7.0): tests/front_door/test_sse_send.py fails if an
    upgrade stops calling it."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is not None:
            await super()._send_with_timeout(send, message)
        else:
            await send(message)


def sse_response(events: AsyncIterator[Item], settings: StreamSettings) -> EventSourceResponse:
    return _EventStream(
        events,
        ping=settings.ping_s,
        sep="\n",
        headers={"Cache-Control": "no-store"},
        # Drain ends streams cleanly just before this; sse-starlette's own cut-off is the backstop.
        shutdown_grace_period=settings.drain_grace_s,
    )
