"""gRPC errors that tell the caller what to do next, including when to retry.

Retry hints travel the standard way: a ``google.rpc.RetryInfo`` detail in the ``grpc-status-details-bin``
trailer, which gRPC clients in every language (and our HTTP edge, as ``Retry-After``) can read.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


# ErrorInfo.reason of an INVALID_ARGUMENT caused by a size limit (the edge answers HTTP 413).
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
ERROR_DOMAIN = "chatmesh"


def status_trailer(
    code: grpc.StatusCode, message: str, *details: ProtoMessage
) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying a google.rpc.Status with ``details`` (RetryInfo, ErrorInfo, ...)."""
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


def retry_info(retry_after_s: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(max(0, round(retry_after_s * 1000)))
    return error_details_pb2.RetryInfo(retry_delay=delay)


def payload_too_large_info(field: str, limit: str) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo that marks an INVALID_ARGUMENT as "too large" (HTTP 413 at the edge)."""
    return error_details_pb2.ErrorInfo(
        reason=PAYLOAD_TOO_LARGE, domain=ERROR_DOMAIN, metadata={"field": field, "limit": limit}
    )


def bad_request(field: str, description: str) -> error_details_pb2.BadRequest:
    """A BadRequest naming the offending field (HTTP 422 at the edge, with ``param`` = field)."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    return error_details_pb2.BadRequest(field_violations=[violation])


def retry_trailer(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying a google.rpc.Status with a RetryInfo detail."""
    return status_trailer(code, message, retry_info(retry_after_s))


async def abort_with_retry(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, retry_after_s: float
) -> None:
    """Ends the RPC with ``code`` and a retry delay (raises, like ``context.abort``)."""
    await context.abort(code, message, trailing_metadata=retry_trailer(code, message, retry_after_s))


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The RetryInfo delay carried by a failed call, in seconds, or None."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key != STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return info.retry_delay.ToMilliseconds() / 1000.0
    return None
