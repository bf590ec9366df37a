"""Errors the orchestrator answers with, and the one place where other errors become gRPC statuses.

``ServiceError`` carries a status code, a message safe to show, and the details clients act on:
a retry delay (``google.rpc.RetryInfo``), the offending field (``BadRequest``, HTTP 422 at the edge), a
size limit (``ErrorInfo`` reason ``PAYLOAD_TOO_LARGE``, HTTP 413) or another machine-readable reason.
memory_store errors name their gRPC code; router errors are gRPC errors already.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2

from chatmesh.errors import (
    ERROR_DOMAIN,
    bad_request,
    payload_too_large_info,
    retry_after_s,
    retry_info,
    status_trailer,
)
from memory_store.errors import MemoryStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Statuses whose messages may hold internals: clients get a generic message, the log keeps the detail.
_OPAQUE = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
GENERIC_MESSAGE = "internal error in the chat service; retry later, and report it if it persists"


@dataclass(eq=False)
class ServiceError(Exception):
    code: grpc.StatusCode
    message: str
    retry_after_s: float | None = None
    # The request field at fault (BadRequest detail).
    field: str | None = None
    # Set for size limits: what the limit is, e.g. "32768 bytes" (ErrorInfo PAYLOAD_TOO_LARGE).
    too_large: str | None = None
    # A machine-readable reason (ErrorInfo), e.g. CONTENT_FILTER.
    reason: str | None = None

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def details(self) -> list[ProtoMessage]:
        details: list[ProtoMessage] = []
        if self.retry_after_s is not None:
            details.append(retry_info(self.retry_after_s))
        if self.too_large is not None:
            details.append(payload_too_large_info(self.field or "", self.too_large))
        elif self.reason is not None:
            details.append(error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN))
        if self.field is not None:
            details.append(bad_request(self.field, self.message))
        return details

    def trailer(self) -> tuple[tuple[str, bytes], ...]:
        return status_trailer(self.code, self.message, *self.details())


def invalid(field: str, message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


def too_large(field: str, message: str, limit: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field, too_large=limit)


def not_found(what: str, ident: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, f"{what} {ident} not found")


def exhausted(message: str, retry_after_s: float) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=max(0.0, retry_after_s))


def unavailable(message: str, retry_after_s: float | None = None) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=retry_after_s)


def from_exception(exc: BaseException) -> ServiceError:
    """Any error as the ServiceError a client should see (unexpected ones are logged, not shown)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, MemoryStoreError):
        code = grpc.StatusCode[exc.code]
        return ServiceError(code, GENERIC_MESSAGE if code in _OPAQUE else str(exc))
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_rpc_error(exc, "a downstream service")
    if isinstance(exc, TimeoutError):
        return unavailable("a downstream service did not answer in time; retry", 1.0)
    log.error("unexpected error", exc_info=exc)
    return ServiceError(grpc.StatusCode.INTERNAL, GENERIC_MESSAGE)


def from_rpc_error(exc: grpc.aio.AioRpcError, who: str) -> ServiceError:
    """A failed downstream call as what our caller should see: the router's verdicts pass through."""
    code = exc.code()
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
        return ServiceError(code, exc.details() or f"{who} refused the request", retry_after_s(exc))
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        return ServiceError(code, exc.details() or f"{who} refused the request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return unavailable(f"{who} did not answer in time; retry", 1.0)
    log.warning("%s failed: %s %s", who, code.name, exc.details())
    return unavailable(f"{who} failed ({code.name}); retry with backoff", 1.0)


async def bounded(call: Awaitable[T], timeout_s: float) -> T:
    """Awaits a downstream call under a deadline (every outgoing call has one)."""
    async with asyncio.timeout(timeout_s):
        return await call
