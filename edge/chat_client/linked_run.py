"""One run-event stream on a completion link (``LinkedRun``): a Complete, or a stored chat's SendMessage,
RegenerateMessage or StreamRun, sent again to another replica when refused before its first event, with
the deltas that arrived together read as one."""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from typing import Any

import grpc
from opentelemetry import trace

from chatmesh.chat.v1 import completion_link_pb2
from chatmesh.errors import DRAINING, ServiceError
from chatmesh.linked_calls import linked_call
from chatmesh.run_events import MAX_MERGED_DELTAS, merged_delta
from edge.chat_client.caller import Caller
from edge.chat_client.replicas import OrchestratorReplica, least_busy_link
from edge.errors import Unanswered
from meshkit.links import LinkBroken
from meshkit.replicas import Replicas
from meshkit.telemetry import request_span, trace_context

# A request refused UNAVAILABLE before its first event (nothing of it started: a draining replica refused
# it, or its stream ended or broke, which cancels it there) is sent this many times in all, each time to
# another replica than those where it failed (when there is one), on a new stream.
START_ATTEMPTS = 3
# How the idempotency key the edge gives a send or regenerate that came without one begins (keys are the
# user's own, and 128 random bits follow, so no key a client chose meets one).
EDGE_KEY_PREFIX = "edge:"


class LinkedRun:
    """One run-event stream on a completion link, read as its call would be (``read`` and ``cancel``):
    its events, then ``grpc.aio.EOF``; a failure raises the ServiceError the orchestrator ended it with
    (``LinkBroken`` when the stream broke, ``Unanswered`` when its run did not start in time).

    A Complete goes on the least busy link of the replicas up; a stored chat's stream on a link of its
    chat's replica (where its run is live). Deltas that arrived together are read as one
    (``chatmesh.run_events``) when the request asked for merged deltas, as the orchestrator merges them
    for a reader that fell behind. A request refused UNAVAILABLE before its first event (its replica
    drains, or its stream broke, which cancels it there) is sent again (``START_ATTEMPTS`` in all;
    ``_resendable`` says which), to another replica than those where it failed (when there is one), on a
    new stream (its start, conversation and all, is kept until the first event only)."""

    def __init__(
        self,
        replicas: Replicas[OrchestratorReplica],
        start: completion_link_pb2.CompleteStart,
        caller: Caller,
        *,
        start_timeout_s: float,
        stream_timeout_s: float,
    ) -> None:
        self._replicas = replicas
        self._start_timeout_s = start_timeout_s
        self._stream_timeout_s = stream_timeout_s
        name, request = linked_call(start)
        self._merge_deltas = request.merge_deltas
        self._chat_id = caller.chat_id if start.WhichOneof("stored") else ""
        # A send or regenerate (the requests with an idempotency key) is sent again only when nothing of
        # it can start twice (``_resendable``). One that came without a key gets one of the edge's making,
        # the same on every attempt: sent again after its stream broke, it joins the run it may have
        # started instead of starting another (the orchestrator would make it a key of its own anyway).
        self._starts_stored_run = "idempotency_key" in request.DESCRIPTOR.fields_by_name
        if self._starts_stored_run and not request.idempotency_key:
            request.idempotency_key = f"{EDGE_KEY_PREFIX}{secrets.token_hex(16)}"
        self._start: completion_link_pb2.CompleteStart | None = start
        self._span = request_span(name, trace.SpanKind.CLIENT)
        self._frames: deque[completion_link_pb2.CompleteResponseFrame] = deque()
        self._failed_on: set[str] = set()  # replicas where it failed UNAVAILABLE
        self._attempts = 1
        self._ended = False
        self._open(start)

    def _open(self, start: completion_link_pb2.CompleteStart) -> None:
        # A new run's first event (`started`) comes once the replica took it: one that does not come in
        # time is refused, as gRPC sheds a call not taken. StreamRun's first event may be the run's
        # next token, however far off.
        self._start_by = (
            None
            if start.HasField("stream_run")
            else asyncio.get_running_loop().time() + self._start_timeout_s
        )
        self._replica, self._link = least_busy_link(self._replicas, self._chat_id, self._failed_on)
        self._request_id = start.request_id = secrets.token_hex(8)
        self._feed = self._link.open(
            start, trace_context(self._span), timeout_ms=round(self._stream_timeout_s * 1000)
        )

    async def read(self) -> Any:
        """The next response (a frame with the ``event``), or ``grpc.aio.EOF`` after the last."""
        while not self._frames:
            if self._ended:
                return grpc.aio.EOF
            try:
                if self._start is None:
                    self._frames.extend(await self._feed.take())
                else:
                    async with asyncio.timeout_at(self._start_by):
                        self._frames.extend(await self._feed.take())
            except TimeoutError:
                # Its `cancel` goes out: should the run start after all, a Complete stops (a send's run
                # goes on, which a retry with its idempotency key joins). As gRPC sheds a call it did
                # not take: CANCELLED (503, too busy, retry).
                self._end()
                message = f"the answer did not start within {self._start_timeout_s:g} s"
                raise Unanswered(grpc.StatusCode.CANCELLED, message) from None
            except ServiceError as error:
                start = self._start
                if start is None or self._attempts >= START_ATTEMPTS or not self._resendable(error):
                    self._end(error)
                    raise
                # It goes to another replica than the one that refused it (draining) or whose stream
                # broke (dead, most likely), on a new stream.
                self._failed_on.add(self._replica.address)
                if not isinstance(error, LinkBroken):
                    self._link.renew()
                self._link.release(self._request_id)
                self._attempts += 1
                self._open(start)
        frame = self._frames.popleft()
        if frame.WhichOneof("kind") == "finished":
            self._end()
            return grpc.aio.EOF
        self._start = None
        if self._merge_deltas and frame.event.HasField("delta") and self._frames:
            return self._merged(frame)
        return frame

    def _resendable(self, error: ServiceError) -> bool:
        """Whether a request that failed with ``error`` before its first event goes again: UNAVAILABLE
        (its replica refused it draining, or its stream broke) for a Complete or StreamRun, which repeat
        harmlessly; a send or regenerate when its replica refused it draining (``DRAINING``: nothing of it
        was stored), or when its stream broke (the replica is gone, most likely: its idempotency key joins
        the run should it have started). Another refusal (busy) is the client's to read, with its retry
        delay (the chat page counts it down)."""
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return False
        return not self._starts_stored_run or error.reason == DRAINING or isinstance(error, LinkBroken)

    def _merged(self, first: completion_link_pb2.CompleteResponseFrame) -> Any:
        deltas, last = [first.event.delta], first.event.seq
        while (
            self._frames
            and self._frames[0].WhichOneof("kind") == "event"
            and self._frames[0].event.HasField("delta")
            and len(deltas) < MAX_MERGED_DELTAS
        ):
            event = self._frames.popleft().event
            deltas.append(event.delta)
            last = event.seq
        merged = merged_delta(
            last,
            [(delta.text, delta.token_count) for delta in deltas],
            [logprob for delta in deltas for logprob in delta.logprobs],
        )
        return completion_link_pb2.CompleteResponseFrame(event=merged)

    def cancel(self) -> None:
        """The caller left: a Complete's answer is cancelled (it cannot be resumed), a stored chat's run
        goes on."""
        self._end()

    def _end(self, error: ServiceError | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self._link.release(self._request_id)
        if error is not None:
            self._span.set_status(trace.StatusCode.ERROR, error.message)
        self._span.end()
