"""The one error type every service raises, aborts with and parses: ``ServiceError``.

A ``ServiceError`` is a gRPC status plus what the caller acts on, carried the standard way as
``google.rpc`` details in the ``grpc-status-details-bin`` trailer, which gRPC clients in every language
(and our HTTP edge) can read:

- ``retry_after_s``: ``RetryInfo`` (``Retry-After`` at the edge);
- ``field``: ``BadRequest`` naming the request field at fault (HTTP 400 with ``param``);
- ``too_large``: ``ErrorInfo`` reason ``PAYLOAD_TOO_LARGE`` with the limit (HTTP 413);
- ``reason``: another machine-readable ``ErrorInfo`` reason (e.g. ``CONTENT_FILTER``).

``private`` is for our logs and traces only: ``abort`` logs it and never sends it. A server ends a call
with ``await abort(context, error)``; a client turns a failed call back into one with ``parse(rpc_error)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2, status_pb2

log = logging.getLogger(__name__)

STATUS_DETAILS_KEY = "grpc-status-details-bin"
# ErrorInfo.reason of an INVALID_ARGUMENT caused by a size limit (the edge answers HTTP 413).
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
ERROR_DOMAIN = "chatmesh"
# ErrorInfo.reason of an UNAVAILABLE from a replica that drains, refusing a run before anything of it was
# stored: it may go to another replica as it is (the edge resends such a send without waiting).
DRAINING = "DRAINING"

# Statuses whose messages may hold internals: clients get GENERIC_MESSAGE, our logs keep the detail.
OPAQUE_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
GENERIC_MESSAGE = "internal error in the chat service; retry later, and report it if it persists"
# A run that ends with one of these (RunError.code) before its first token was refused for a reason that
# may pass by itself: the engine's queue limit, no engine or router left. Nothing of it was generated, so
# a retry is answered anew: the orchestrator answers its idempotency key's retry with a new run, and the
# edge answers a request that waited for such a run with the HTTP error to retry (429 or 503).
REFUSED_BEFORE_ANSWER = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED.name, grpc.StatusCode.UNAVAILABLE.name})
# A status message travels in a header (grpc-message): one that quotes a huge input (a 40 KB id) is more
# than a proxy takes, and Envoy would answer UNAVAILABLE in its place. Messages are cut to this length.
MAX_MESSAGE_CHARS = 512


@dataclass(eq=False)  # exceptions must stay hashable
class ServiceError(Exception):
    code: grpc.StatusCode
    # Safe to show to whoever made the request.
    message: str
    retry_after_s: float | None = None
    # The request field at fault (BadRequest detail).
    field: str | None = None
    # Set for size limits: what the limit is, e.g. "32768 bytes" (ErrorInfo PAYLOAD_TOO_LARGE).
    too_large: str | None = None
    # A machine-readable reason (ErrorInfo), e.g. CONTENT_FILTER.
    reason: str | None = None
    # For logs and traces only; never sent to the caller.
    private: str | None = None

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE_CHARS:
            self.message = self.message[: MAX_MESSAGE_CHARS - 1] + "…"

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def details(self) -> list[ProtoMessage]:
        details: list[ProtoMessage] = []
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(max(0, round(self.retry_after_s * 1000)))
            details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        if self.too_large is not None:
            metadata = {"field": self.field or "", "limit": self.too_large}
            details.append(
                error_details_pb2.ErrorInfo(reason=PAYLOAD_TOO_LARGE, domain=ERROR_DOMAIN, metadata=metadata)
            )
        elif self.reason is not None:
            details.append(error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN))
        if self.field is not None:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.message
            )
            details.append(error_details_pb2.BadRequest(field_violations=[violation]))
        return details

    def status(self) -> bytes:
        """This error as a serialized google.rpc.Status with its details: what a failed call carries in its
        trailer, and what a request that fails on a stream shared by many carries in its last frame."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        for detail in self.details():
            status.details.add().Pack(detail)
        return status.SerializeToString()

    def trailer(self) -> tuple[tuple[str, bytes], ...]:
        """Trailing metadata carrying a google.rpc.Status with this error's details."""
        return ((STATUS_DETAILS_KEY, self.status()),)


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """Ends the RPC with ``error`` and its details (raises, like ``context.abort``)."""
    if error.private:
        log.warning("%s (private detail: %s)", error, error.private)
    await context.abort(error.code, error.message, trailing_metadata=error.trailer())


def parse(error: grpc.RpcError) -> ServiceError:
    """A failed call as the ServiceError its server aborted with (details read back from the trailer)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or ""
    parsed = ServiceError(code, message)
    trailers: Any = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            _read_details(status_pb2.Status.FromString(value), parsed)
    return parsed


def from_status(serialized: bytes) -> ServiceError:
    """The ServiceError a serialized google.rpc.Status stands for (``ServiceError.status``'s inverse)."""
    status = status_pb2.Status.FromString(serialized)
    parsed = ServiceError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)
    _read_details(status, parsed)
    return parsed


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _read_details(status: status_pb2.Status, parsed: ServiceError) -> None:
    """Sets ``parsed``'s retry delay, size limit, reason and field from ``status``'s details."""
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            parsed.retry_after_s = info.retry_delay.ToMilliseconds() / 1000.0
        elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.reason == PAYLOAD_TOO_LARGE:
                parsed.too_large = info.metadata.get("limit", "")
            else:
                parsed.reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                parsed.field = bad.field_violations[0].field


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The RetryInfo delay carried by a failed call, in seconds, or None."""
    return parse(error).retry_after_s


def public_message(code: grpc.StatusCode, message: str) -> str:
    """What a client may read of a status message: opaque codes get the generic one."""
    return GENERIC_MESSAGE if code in OPAQUE_CODES else message


def invalid(field: str, message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


def too_large(field: str, message: str, limit: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field, too_large=limit)


def not_found(what: str, ident: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, f"{what} {ident} not found")


def exhausted(message: str, retry_after_s: float) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s=max(0.0, retry_after_s))


def unavailable(message: str, retry_after_s: float | None = None, reason: str | None = None) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, retry_after_s=retry_after_s, reason=reason)
