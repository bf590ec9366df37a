"""How the orchestrator turns what went wrong into the ``ServiceError`` its caller sees (the one place).

memory_store errors are matched by type; a router's verdict passes through with its retry delay;
anything unexpected becomes INTERNAL with a generic message, its detail kept private for the log.
Capacity failures (UNAVAILABLE, RESOURCE_EXHAUSTED) keep their code and retry delay but not their text:
the router's names engines and addresses, Cassandra's driver names hosts. Users read what to do; the
text goes to our logs and traces as the error's ``private`` detail.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc

from chatmesh.errors import GENERIC_MESSAGE, ServiceError, parse, public_message, unavailable
from memory_store.errors import MemoryStoreError

log = logging.getLogger(__name__)

# A downstream verdict our caller can act on as it is (with its retry delay where one was given).
_PASSED_THROUGH = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


# What a client reads of a capacity failure downstream, and the retry delay it gets when none was given.
CAPACITY_MESSAGES = {
    grpc.StatusCode.UNAVAILABLE: "no model server can answer right now; retry in a moment",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the model servers are busy; retry after the delay given",
}
STORAGE_UNAVAILABLE = "chat storage is unavailable right now; retry in a moment"
DEFAULT_RETRY_S = 1.0


def from_exception(exc: BaseException) -> ServiceError:
    """Any error as the ServiceError a client should see (unexpected ones are logged, not shown)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, MemoryStoreError):
        code = grpc.StatusCode[exc.code]
        if code == grpc.StatusCode.UNAVAILABLE:
            storage = unavailable(STORAGE_UNAVAILABLE, DEFAULT_RETRY_S)
            storage.private = str(exc)
            return storage
        return ServiceError(code, public_message(code, str(exc)), private=str(exc))
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_rpc_error(exc, "a downstream service")
    if isinstance(exc, TimeoutError):
        return unavailable("a downstream service did not answer in time; retry", DEFAULT_RETRY_S)
    log.error("unexpected error", exc_info=exc)
    return ServiceError(grpc.StatusCode.INTERNAL, GENERIC_MESSAGE, private=f"unexpected error: {exc!r}")


def from_rpc_error(exc: grpc.aio.AioRpcError, who: str) -> ServiceError:
    """A failed downstream call as what our caller should see (``from_downstream``)."""
    return from_downstream(parse(exc), who)


def from_downstream(error: ServiceError, who: str) -> ServiceError:
    """What a downstream service said (of a call, or of one request on a shared stream) as what our
    caller should see: the router's verdicts pass through, capacity failures with our own words (see the
    module's doc)."""
    error = dataclasses.replace(error)
    if error.code in CAPACITY_MESSAGES:
        error.private = f"{who}: {error.message}"
        log.warning("%s answered %s: %s", who, error.code.name, error.message)
        error.message = CAPACITY_MESSAGES[error.code]
        error.retry_after_s = DEFAULT_RETRY_S if error.retry_after_s is None else error.retry_after_s
        return error
    if error.code in _PASSED_THROUGH:
        error.message = error.message or f"{who} refused the request"
        return error
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return unavailable(f"{who} did not answer in time; retry", DEFAULT_RETRY_S)
    log.warning("%s failed: %s %s", who, error.code.name, error.message)
    failed = unavailable(f"{who} failed ({error.code.name}); retry with backoff", DEFAULT_RETRY_S)
    failed.private = f"{who} failed: {error.code.name} {error.message}"
    return failed
