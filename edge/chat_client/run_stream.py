"""Reading a run's events for the edge (``RunStream``): the opening event and the refusal before the first
token that becomes an HTTP status, then the rest; a stored chat's stream that breaks UNAVAILABLE is
attached again with StreamRun after the last event relayed (its sequence number), so the client sees
one unbroken stream.

A stored chat's run outlives the orchestrator replica streaming it (another replica adopts it, or it
is handed over at a drain): the edge attaches again for ``REATTACH_FOR_S``, with backoff. A Complete
cannot be resumed (nothing stored it), so its failure is the client's to see. Cancelling a stream here
only detaches this client: the orchestrator keeps a stored chat's run going until it ends or someone
calls CancelRun.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Container
from typing import Any

import grpc

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from edge.chat_client.linked_run import LinkedRun
from edge.drain import Drain
from edge.errors import ApiError, from_run_error, from_service_error

log = logging.getLogger(__name__)

# How long a broken run stream is attached again before its failure reaches the client: longer than
# an orchestrator replica takes to be found lost and its runs adopted (orphan_after_s and a reap pass).
REATTACH_FOR_S = 30.0
_REATTACH_FIRST_DELAY_S = 0.1
_REATTACH_MAX_DELAY_S = 2.0

# StreamRun(run_id, after_seq): a stream that attaches to a run after the events already relayed (asking
# for merged deltas as the one it replaces did).
Reattach = Callable[[str, int], LinkedRun]


class RunStream:
    """An open server stream of RunEvents (SendMessage, RegenerateMessage, StreamRun, Complete)."""

    def __init__(
        self,
        linked: LinkedRun,
        drain: Drain,
        reattach: Reattach | None = None,
        run_id: str = "",
        after_seq: int = 0,
    ) -> None:
        self._drain = drain
        self._linked = linked
        self._reattach = reattach
        # The run (known from the request, or from its `started` event) and the last event relayed.
        self._run_id = run_id
        self._last_seq = after_seq
        self._read_ahead: chat_pb2.RunEvent | None = None  # read by ``opening_answer``, relayed next

    async def first(self) -> chat_pb2.RunEvent | None:
        """The first event, or None for a stream that ended without one (StreamRun after a finished run's
        last event); a call that fails before it raises ApiError (so the HTTP status can say why). When
        the edge drains before the first event comes, it is a 503 to retry (the same Idempotency-Key
        joins the answer if it started), never a request cut off without a status."""
        try:
            with self._drain.watch() as drain:
                response: Any = await drain.wait(self._linked.read())
        except ServiceError as exc:
            raise from_service_error(exc) from exc
        except TimeoutError:
            self.detach()
            raise ApiError(
                503,
                "the server is restarting; retry the request",
                type="server_error",
                code="draining",
                retry_after_s=1.0,
            ) from None
        if response is grpc.aio.EOF:
            return None
        self._saw(response.event)
        return response.event

    def _saw(self, event: chat_pb2.RunEvent) -> None:
        if event.WhichOneof("kind") == "started":
            self._run_id = event.started.run_id
        self._last_seq = event.seq

    async def opening(self) -> chat_pb2.RunEvent:
        """The first event of a stream that always has one (SendMessage, Complete, StreamRun from its
        start): a stream that ends without any is the chat service's fault, 502."""
        first = await self.first()
        if first is None:
            raise ApiError(502, "the chat service ended the stream without any event", type="server_error")
        return first

    async def opening_answer(self, raising: Container[str] | None = None) -> chat_pb2.RunEvent:
        """The opening event, held until the event after `started`: a run refused before its first
        token (an engine dropped it from its queue when its TTFT objective ran out: RESOURCE_EXHAUSTED
        with a retry delay) raises ApiError, so the client gets a status it can act on (429 with
        Retry-After, which OpenAI's SDKs retry) rather than an error after a 200. ``raising``: the
        RunError codes that raise (default: every one). The event read ahead is the first that
        ``rest`` yields."""
        first = await self.opening()
        if first.WhichOneof("kind") != "started":
            return first
        following = await self.first()
        if following is not None and following.WhichOneof("kind") == "error":
            error = following.error
            if raising is None or error.code in raising:
                raise from_run_error(error.code, error.message, error.retry_after_ms)
        self._read_ahead = following
        return first

    async def rest(self) -> AsyncIterator[chat_pb2.RunEvent]:
        """The events after the first; a failure mid-stream raises ServiceError (after attaching again
        for ``REATTACH_FOR_S`` where the run can be resumed)."""
        if self._read_ahead is not None:
            event, self._read_ahead = self._read_ahead, None
            yield event
        given_up_at: float | None = None
        delay = _REATTACH_FIRST_DELAY_S
        while True:
            try:
                response: Any = await self._linked.read()
            except ServiceError as exc:
                if not self._resumable(exc):
                    raise
                now = time.monotonic()
                given_up_at = given_up_at or now + REATTACH_FOR_S
                if now + delay > given_up_at:
                    raise
                log.info(
                    "run %s: stream broke (%s); attaching again after event %d",
                    self._run_id,
                    exc.code.name,
                    self._last_seq,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, _REATTACH_MAX_DELAY_S)
                assert self._reattach is not None
                self._linked = self._reattach(self._run_id, self._last_seq)
                continue
            if response is grpc.aio.EOF:
                return
            given_up_at, delay = None, _REATTACH_FIRST_DELAY_S
            self._saw(response.event)
            yield response.event

    def _resumable(self, exc: ServiceError) -> bool:
        return self._reattach is not None and bool(self._run_id) and exc.code == grpc.StatusCode.UNAVAILABLE

    async def events(self, first: chat_pb2.RunEvent) -> AsyncGenerator[chat_pb2.RunEvent, None]:
        """``first`` and the events after it; a failure mid-stream raises ApiError. Detaches when closed
        (read it inside ``contextlib.aclosing`` to stop early)."""
        try:
            yield first
            async for event in self.rest():
                yield event
        except ServiceError as exc:
            raise from_service_error(exc) from exc
        finally:
            self.detach()

    def detach(self) -> None:
        """Stops reading. A chat's run goes on (only CancelRun stops it); a Complete is cancelled."""
        self._linked.cancel()
