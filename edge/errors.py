"""HTTP errors the edge answers with, and how orchestrator gRPC statuses become them.

Every error is JSON in OpenAI's shape, ``{"error": {"message", "type", "code", "param"}}``, so the
official SDKs raise the right exception class and the chat page can show ``message`` as it is.
Envoy's own replies (401, 429, 503) use the same shape (see envoy/envoy.yaml.j2, local_reply_config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from starlette.responses import JSONResponse

from chatmesh.errors import STATUS_DETAILS_KEY, retry_after_s

# ErrorInfo.reason the orchestrator attaches to INVALID_ARGUMENT when a size limit was exceeded.
PAYLOAD_TOO_LARGE_REASON = "PAYLOAD_TOO_LARGE"


@dataclass(eq=False)  # exceptions must stay hashable
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after_s: float | None = None

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            # Retry-After takes whole seconds; never round a wait down to "now".
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


# gRPC status -> (HTTP status, OpenAI-style error type). Codes not listed are internal errors (500).
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# Messages of these codes may hold internals; clients get a generic one (the details are in our logs).
_OPAQUE = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})


def _details(error: grpc.RpcError) -> list:
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            return list(status_pb2.Status.FromString(value).details)
    return []


def _refine_invalid_argument(error: grpc.RpcError, base: ApiError) -> ApiError:
    """INVALID_ARGUMENT becomes 413 for a size limit (ErrorInfo reason) or 422 naming the field (BadRequest)."""
    for detail in _details(error):
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.reason == PAYLOAD_TOO_LARGE_REASON:
                base.status, base.code = 413, "payload_too_large"
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and base.status == 400:
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                base.status, base.code = 422, "invalid_value"
                base.param = bad.field_violations[0].field
    return base


def from_status(code: grpc.StatusCode, message: str, retry_after: float | None = None) -> ApiError:
    """The HTTP error for a gRPC status code (from a failed call or a RunError event)."""
    status, kind = _GRPC_TO_HTTP.get(code, (500, "server_error"))
    if code in _OPAQUE:
        message = "internal error in the chat service; retry later, and report it if it persists"
    if retry_after is None and status == 429:
        retry_after = 1.0  # RESOURCE_EXHAUSTED without a hint: still tell clients to back off
    return ApiError(status, message or code.name.lower(), kind, code.name.lower(), retry_after_s=retry_after)


def from_run_error(code_name: str, message: str, retry_after_ms: int) -> ApiError:
    """The HTTP error for a RunError event (its code is a gRPC status code name)."""
    code = grpc.StatusCode.__members__.get(code_name.upper(), grpc.StatusCode.UNKNOWN)
    return from_status(code, message, retry_after_ms / 1000 if retry_after_ms else None)


def from_rpc_error(error: grpc.RpcError) -> ApiError:
    """The HTTP error for a failed orchestrator call, with Retry-After from its RetryInfo detail."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or ""
    api_error = from_status(code, message, retry_after_s(error))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        api_error = _refine_invalid_argument(error, api_error)
    return api_error
