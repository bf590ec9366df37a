"""gRPC errors that tell the caller what to do next, including when to retry.

Retry hints travel the standard way: a ``google.rpc.RetryInfo`` detail in the ``grpc-status-details-bin``
trailer, which gRPC clients in every language (and our HTTP edge, as ``Retry-After``) can read.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"


def retry_trailer(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying a google.rpc.Status with a RetryInfo detail."""
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(max(0, round(retry_after_s * 1000)))
    detail = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(detail)
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


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
