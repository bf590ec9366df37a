"""HTTP errors the edge answers with, and how orchestrator gRPC statuses become them.

Every error is JSON in OpenAI's shape, ``{"error": {"message", "type", "code", "param"}}``, so the
official SDKs raise the right exception class and the chat page can show ``message`` as it is.
Envoy's own replies (401, 429, 503) use the same shape (see envoy/envoy.yaml.j2, local_reply_config).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import grpc
from starlette.responses import JSONResponse

from chatmesh.errors import ServiceError, public_message
from meshkit.links import LinkBroken

log = logging.getLogger(__name__)
# A chat service that cannot be reached (no replica up, a connection reset): what users read instead of
# the transport's text, and how soon to retry.
UNREACHABLE_MESSAGE = "the chat service cannot be reached right now; retry in a moment"
UNREACHABLE_RETRY_S = 1.0
# An answer whose run the chat service did not start in time (as gRPC sheds a call that waited longer
# than the server's --max-pending-s: CANCELLED). Overload, not a cancel (the edge's own cancels answer no
# one), and the run never started, so it is safe to retry.
BUSY_MESSAGE = "the chat service is too busy to take this request; retry in a moment"


class Unanswered(ServiceError):
    """A request the chat service did not answer with a status of its own: the edge gave up waiting for
    its run to start or for its deadline, or it answered out of contract. As with a link that broke
    (``LinkBroken``), its text is for the logs, not for users."""


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


def from_status(code: grpc.StatusCode, message: str, retry_after: float | None = None) -> ApiError:
    """The HTTP error for a gRPC status code (from a failed call or a RunError event)."""
    status, kind = _GRPC_TO_HTTP.get(code, (500, "server_error"))
    if retry_after is None and status == 429:
        retry_after = 1.0  # RESOURCE_EXHAUSTED without a hint: still tell clients to back off
    message = public_message(code, message) or code.name.lower()
    return ApiError(status, message, kind, code.name.lower(), retry_after_s=retry_after)


def from_run_error(code_name: str, message: str, retry_after_ms: int) -> ApiError:
    """The HTTP error for a RunError event (its code is a gRPC status code name)."""
    code = grpc.StatusCode.__members__.get(code_name.upper(), grpc.StatusCode.UNKNOWN)
    return from_status(code, message, retry_after_ms / 1000 if retry_after_ms else None)


def from_service_error(error: ServiceError) -> ApiError:
    """The HTTP error for a failed orchestrator request: Retry-After from its retry delay, and an
    INVALID_ARGUMENT refined to 413 for a size limit or to name the field at fault (``param``). A failure
    that is not the service's answer (``LinkBroken``, ``Unanswered``) shows users a plain text."""
    code, message, retry_after_s = error.code, error.message, error.retry_after_s
    if isinstance(error, LinkBroken | Unanswered):
        if code == grpc.StatusCode.UNAVAILABLE:
            log.warning("chat service unreachable: %s", message)
            message, retry_after_s = UNREACHABLE_MESSAGE, UNREACHABLE_RETRY_S
        elif code == grpc.StatusCode.CANCELLED:
            log.warning("chat service did not start an answer: %s", message)
            code, message, retry_after_s = grpc.StatusCode.UNAVAILABLE, BUSY_MESSAGE, UNREACHABLE_RETRY_S
    api_error = from_status(code, message, retry_after_s)
    if code == grpc.StatusCode.NOT_FOUND and error.field in ("options.model", "model"):
        api_error.code, api_error.param = "model_not_found", error.field  # as OpenAI names it
    if code != grpc.StatusCode.INVALID_ARGUMENT:
        return api_error
    if error.too_large is not None:
        api_error.status, api_error.code = 413, "payload_too_large"
    elif error.field:
        api_error.code, api_error.param = "invalid_value", error.field
    return api_error
