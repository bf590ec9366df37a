"""CompletionLinkService: the edge's Complete calls, its stored chats' run streams, and its unary
calls, many on one stream (``meshkit.links``).

Each request is its call in all but its transport: the token its start carries is verified as the call's
metadata is, its request is checked as its run is made (``service.run_events``, the calls' own), its
events are followed to the end within its deadline, and a failure ends it with the status the call
would have ended with. A `cancel` (the caller left), or the stream ending, is the call cancelled: a
Complete's answer is cancelled, a stored chat's run goes on without this reader (``Starts.answer``). A
unary call is answered by ``ChatService.answer``, as the call is, its response the one `reply`.

Why: a run-event call costs a gRPC message per event each way, and gRPC sends each with a system call of
its own (a quarter of the orchestrator's main thread holding 100 SSE streams went to those sends). Here
the events of every request of one loop turn leave in one message. And every call costs the server an
accept, which gRPC's asyncio server does one a loop turn: with 800 stored streams open (the loop ~200 ms
late) CancelRun calls were taken ~5 a second, and most of them ran past their 10 s; the requests of one
message here start in one turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from chatmesh.chat.v1 import completion_link_pb2, completion_link_pb2_grpc
from chatmesh.errors import ServiceError
from chatmesh.identity import Identity, TokenVerifier, Unauthenticated
from chatmesh.linked_calls import UNARY_CALLS, linked_call, linked_reply, method_of
from meshkit.deadline import Deadline
from meshkit.links import LinkMessages, ServedRequests
from orchestrator.api.service import ChatService, run_events
from orchestrator.errors import from_exception
from orchestrator.runs.starts import SHUTTING_DOWN

log = logging.getLogger(__name__)

COMPLETION_LINK = LinkMessages.of(completion_link_pb2)
CALLER_LEFT = "the caller cancelled the request"


class CompletionLinkService(completion_link_pb2_grpc.CompletionLinkServiceServicer):
    def __init__(self, chat: ChatService, verifier: TokenVerifier) -> None:
        self.chat = chat
        self.verifier = verifier
        self.draining = False
        self._streams: set[asyncio.Event] = set()  # wake-ups of the open CompleteMany calls

    def drain(self) -> None:
        """Each open stream ends once no request is left on it (``Starts.admit`` refuses new ones)."""
        self.draining = True
        for wake in self._streams:
            wake.set()

    async def CompleteMany(
        self,
        request_iterator: AsyncIterator[completion_link_pb2.CompleteManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[completion_link_pb2.CompleteManyResponse]:
        if self.draining:
            # Refused as a call, before anything is read: its first requests are the caller's to send
            # elsewhere (Envoy retries such a stream on another replica). Served, it would end at once,
            # empty, and the starts already on their way would be lost with it.
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        async for message in _ServedCompletes(self).serve(request_iterator, self._streams):
            yield message


class _ServedCompletes(ServedRequests):
    """The requests of one ``CompleteMany`` call: each follows its run (or answers its unary call) in a
    task of its own, under its server span."""

    def __init__(self, service: CompletionLinkService) -> None:
        super().__init__(COMPLETION_LINK, lambda: service.draining)
        self._service = service
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, request_id: str, frame: completion_link_pb2.CompleteRequestFrame) -> None:
        try:
            identity = self._service.verifier.identity(frame.start.authorization)
        except Unauthenticated as exc:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        name, request = linked_call(frame.start)
        self.span(request_id).update_name(name)
        timeout_s = frame.timeout_ms / 1000 if frame.timeout_ms else None
        method = method_of(request)
        if method in UNARY_CALLS:
            frames = self._reply(method, identity, request, timeout_s)
        else:
            try:
                events = run_events(self._service.chat.ctx, identity, request)
            except Exception as exc:
                raise from_exception(exc) from None
            frames = (COMPLETION_LINK.response_frame(event=event) async for event in events)
        task = self._tasks[request_id] = asyncio.create_task(self._follow(request_id, frames, timeout_s))
        task.add_done_callback(functools.partial(self._cancelled_before_it_ran, request_id))

    def cancel(self, request_id: str) -> None:
        # ``Starts.answer`` cancels a Complete its caller left; a stored chat's run goes on.
        self._tasks[request_id].cancel()

    def _cancelled_before_it_ran(self, request_id: str, task: asyncio.Task[None]) -> None:
        # A `cancel` in the message of its `start` cancels the task before its first step, which
        # then never ends the request itself (and the stream would wait for it forever).
        if task.cancelled():
            if self._tasks.get(request_id) is task:
                del self._tasks[request_id]
            self.finish(request_id, ServiceError(grpc.StatusCode.CANCELLED, CALLER_LEFT))

    def stop(self, request_id: str) -> None:
        self._tasks.pop(request_id).cancel()

    async def _reply(
        self, method: str, identity: Identity, request: Any, within_s: float | None
    ) -> AsyncIterator[completion_link_pb2.CompleteResponseFrame]:
        response = await self._service.chat.answer(method, identity, request, within_s)
        yield COMPLETION_LINK.response_frame(reply=linked_reply(method, response))

    async def _follow(
        self,
        request_id: str,
        frames: AsyncIterator[completion_link_pb2.CompleteResponseFrame],
        timeout_s: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        error: ServiceError | None = None
        try:
            with (
                trace.use_span(self.span(request_id), end_on_exit=False),
                Deadline(None if timeout_s is None else loop.time() + timeout_s) as deadline,
            ):
                while True:
                    frame = await deadline.wait(anext(frames))
                    frame.request_id = request_id
                    self.send(frame)
        except StopAsyncIteration:
            pass
        except TimeoutError:
            error = ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
        except asyncio.CancelledError:
            # The caller left (or the stream is ending, when nothing more is sent for it).
            error = ServiceError(grpc.StatusCode.CANCELLED, CALLER_LEFT)
        except Exception as exc:
            error = from_exception(exc)
            if error.private:
                log.warning("%s (private detail: %s)", error, error.private)
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]
        self.finish(request_id, error)
