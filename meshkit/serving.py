"""How every chatmesh gRPC server starts, reports health, and drains on SIGTERM.

Each server gets the standard ``grpc.health.v1`` service and server reflection. On SIGTERM or SIGINT
it flips health to NOT_SERVING (so load balancers stop sending work), lets the service stop accepting
new work (``on_drain``), and gives in-flight streams ``drain_grace_s`` seconds to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from argparse import Namespace
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from meshkit import telemetry
from meshkit.config import DEFAULT_MAX_PENDING_CALLS, DEFAULT_MAX_PENDING_S
from meshkit.malformed import RejectMalformed

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Keepalives detect dead peers on long-lived streams (engine KV events, token streams).
_SERVER_OPTIONS = (
    # gRPC enables SO_REUSEPORT by default, letting a second server silently share a taken port.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
)


def server_options(
    max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS, max_pending_s: int = DEFAULT_MAX_PENDING_S
) -> tuple[tuple[str, int], ...]:
    """The options of every chatmesh gRPC server. Past ``max_pending_calls`` calls not yet taken by the
    service, gRPC sheds new ones (CANCELLED, at random, up to twice that, then every one); so it does a
    call that waited ``max_pending_s`` seconds to be taken."""
    return (
        *_SERVER_OPTIONS,
        ("grpc.server.max_pending_requests", max_pending_calls),
        ("grpc.server.max_pending_requests_hard_limit", 2 * max_pending_calls),
        ("grpc.server_max_unrequested_time_in_server", max_pending_s),
    )


CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


# How long a draining server keeps answering NOT_SERVING before it refuses new calls.
DRAIN_NOTICE_S = 0.5


class PortInUseError(RuntimeError):
    """The port a server must listen on is taken."""


@dataclass
class GrpcServer:
    """A started server and the health service that fronts it."""

    server: grpc.aio.Server
    health: HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def drain(
        self, grace_s: float, on_drain: Callable[[], Awaitable[None]] | None = None, notice_s: float = 0.0
    ) -> None:
        """NOT_SERVING for ``notice_s`` (health checkers see it while new calls still work), then stop
        accepting calls and give open ones ``grace_s`` seconds."""
        await self.health.enter_graceful_shutdown()
        if on_drain is not None:
            await on_drain()
        await asyncio.sleep(notice_s)
        await self.server.stop(grace_s)


async def start_grpc_server(
    add_services: Callable[[grpc.aio.Server], Iterable[str]],
    port: int,
    host: str = "127.0.0.1",
    max_pending_calls: int = DEFAULT_MAX_PENDING_CALLS,
    max_pending_s: int = DEFAULT_MAX_PENDING_S,
) -> GrpcServer:
    """Creates, binds and starts a server. ``add_services`` registers servicers and returns their full names.
    Requests that do not parse are refused INVALID_ARGUMENT before any servicer sees them (RejectMalformed)."""
    server = grpc.aio.server(
        interceptors=[RejectMalformed()],
        options=server_options(max_pending_calls, max_pending_s),
    )
    names = tuple(add_services(server))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc}; is another process using it?") from exc
    if bound == 0:
        raise PortInUseError(f"cannot listen on {host}:{port}: the port is in use or not permitted")
    await server.start()
    handle = GrpcServer(server=server, health=health, port=bound, service_names=names)
    await handle.set_serving(True)
    return handle


async def start_from_flags(
    add_services: Callable[[grpc.aio.Server], Iterable[str]], args: Namespace
) -> GrpcServer:
    """``start_grpc_server`` with the standard flags (see ``ServiceArgs.add_server_flags``)."""
    return await start_grpc_server(
        add_services,
        args.port,
        args.host,
        max_pending_calls=args.max_pending_calls,
        max_pending_s=args.max_pending_s,
    )


async def serve_until_signalled(
    handle: GrpcServer,
    name: str,
    drain_grace_s: float,
    on_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Runs until SIGTERM/SIGINT, then drains and stops the server."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("%s serving on port %d (services: %s)", name, handle.port, ", ".join(handle.service_names))
    await stop.wait()
    log.info("%s draining: health NOT_SERVING, up to %.0fs for in-flight streams", name, drain_grace_s)
    await handle.drain(drain_grace_s, on_drain, notice_s=DRAIN_NOTICE_S)
    log.info("%s stopped", name)


async def serve(
    name: str,
    args: Namespace,
    add_services: Callable[[grpc.aio.Server], Iterable[str]],
    on_drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Starts a server from the standard flags (see ``ServiceArgs.add_server_flags``) and runs it until signalled."""
    telemetry.start_metrics_server(args.metrics_port, args.host)
    handle = await start_from_flags(add_services, args)
    await serve_until_signalled(handle, name, args.drain_grace_s, on_drain)
