"""The edge's unary ChatService calls (CreateChat, GetChat, CancelRun...): each a request on the least
busy completion link of the replica its chat hashes to, with a deadline; one that reads or repeats
harmlessly (``IDEMPOTENT_METHODS``) is tried on another replica when one refuses it UNAVAILABLE."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from chatmesh.chat.v1 import completion_link_pb2
from chatmesh.errors import ServiceError
from chatmesh.linked_calls import linked_call, linked_start, method_of, reply_response
from edge.chat_client.caller import Caller
from edge.chat_client.replicas import OrchestratorReplica, unreachable
from edge.errors import Unanswered, from_service_error
from meshkit.envoy import IDEMPOTENT_METHODS
from meshkit.links import Link
from meshkit.replicas import Replicas
from meshkit.telemetry import request_span, trace_context

# A call that reads (or repeats harmlessly) is tried on this many replicas when they answer UNAVAILABLE,
# as Envoy retries it; another call goes to one (a send refused there is the client's to retry, with its
# idempotency key).
UNARY_ATTEMPTS = 3
_UNARY_RETRY_DELAY_S = 0.05


async def unary(
    replicas: Replicas[OrchestratorReplica], method: str, request: Message, caller: Caller, timeout_s: float
) -> Any:
    """Calls ``method`` within ``timeout_s`` on the caller's replica and returns its response message; a
    failure raises the matching ApiError. (The response type is the caller's to know.)"""
    tried: set[str] = set()
    attempts = UNARY_ATTEMPTS if method in IDEMPOTENT_METHODS else 1
    while True:
        replica = replicas.pick(caller.chat_id, tried)
        try:
            if replica is None:
                raise unreachable()
            start = linked_start(method, caller.authorization, request)
            return await linked_unary(replica.least_busy_link(), start, timeout_s)
        except ServiceError as exc:
            if replica is None or not _tried_again(replicas, exc, tried, replica.address, attempts):
                raise from_service_error(exc) from exc
            await asyncio.sleep(_UNARY_RETRY_DELAY_S)


def _tried_again(
    replicas: Replicas[OrchestratorReplica], exc: ServiceError, tried: set[str], address: str, attempts: int
) -> bool:
    """Whether a call that failed with ``exc`` on ``address`` goes to another replica: UNAVAILABLE (the
    replica drains, or cannot be reached), fewer than ``attempts`` made, and another replica left (else
    the client reads this one's answer)."""
    tried.add(address)
    return (
        exc.code == grpc.StatusCode.UNAVAILABLE and len(tried) < attempts and bool(replicas.candidates(tried))
    )


async def linked_unary(link: Link, start: completion_link_pb2.CompleteStart, timeout_s: float) -> Any:
    """The response of the unary call ``start`` stands for, made on ``link`` within ``timeout_s``;
    a failure raises the ServiceError the call would have ended with (DEADLINE_EXCEEDED past its time,
    when its `cancel` goes out). Why not a call: the orchestrator's gRPC server takes one new call a loop turn,
    and a replica whose loop runs late under load (800 stored streams) took a few a second, so a cancel
    waited there for longer than its time; the requests of one link message start in one turn."""
    name, request = linked_call(start)
    method = method_of(request)
    span = request_span(name, trace.SpanKind.CLIENT)
    start.request_id = secrets.token_hex(8)
    feed = link.open(start, trace_context(span), timeout_ms=round(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            while frames := await feed.take():
                for frame in frames:
                    if frame.WhichOneof("kind") == "reply":
                        return reply_response(method, frame.reply)
        raise ValueError(f"the {method} call ended without its response")
    except TimeoutError:
        span.set_status(trace.StatusCode.ERROR, "the call's deadline passed")
        raise Unanswered(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
    except ServiceError as error:
        span.set_status(trace.StatusCode.ERROR, error.message)
        raise
    except ValueError as exc:  # the orchestrator answered out of contract
        span.set_status(trace.StatusCode.ERROR, str(exc))
        raise Unanswered(grpc.StatusCode.INTERNAL, str(exc)) from None
    finally:
        link.release(start.request_id)
        span.end()
