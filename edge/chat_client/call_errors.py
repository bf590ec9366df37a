"""How a request on a completion link fails to the edge: as the ``grpc.aio.AioRpcError`` its call would
have raised, so ``edge.errors.from_rpc_error`` answers both the same way (the orchestrator's status
details when it sent them; none, so no transport text reaches users, when the link or the clock failed)."""

from __future__ import annotations

import grpc

from chatmesh.errors import ServiceError
from meshkit.links import LinkBroken


def not_started(timeout_s: float) -> grpc.aio.AioRpcError:
    """A request whose run did not start in time, as gRPC reports a call it shed: CANCELLED without
    details (the edge answers 503, too busy, retry)."""
    return transport_error(grpc.StatusCode.CANCELLED, f"the answer did not start within {timeout_s:g} s")


def transport_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """A failure as the transport reports one: without status details (its text is not for users)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


def call_error(error: ServiceError) -> grpc.aio.AioRpcError:
    """``error`` as a failed call reports it: the orchestrator's status details in the trailer, or none
    when the stream broke (the transport's failure, whose text is not for users)."""
    trailer = () if isinstance(error, LinkBroken) else error.trailer()
    return grpc.aio.AioRpcError(error.code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), error.message)


def unreachable() -> grpc.aio.AioRpcError:
    """No replica of the chat service is known: the error of a call that cannot connect."""
    return call_error(LinkBroken(grpc.StatusCode.UNAVAILABLE, "no chat service replica is known"))
