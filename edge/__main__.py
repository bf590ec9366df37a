"""``python -m edge``: the HTTP/SSE edge in front of ChatService.

Served by granian (a Rust HTTP server) on this process's event loop. It speaks HTTP/2 without TLS to
Envoy, so one connection carries many open answer streams instead of one each: holding 10,000 SSE streams
then costs Envoy 10,000 sockets (its clients'), not 20,000, and the edge a few. Anyone else (health
checks, curl) gets HTTP/1.1 on the same port.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP2Settings
from granian.log import LogLevels
from granian.server.embed import Server
from sse_starlette.sse import AppStatus
from starlette.types import ASGIApp

from chatmesh.identity import TokenVerifier
from edge.app import create_app
from edge.drain import Drain
from edge.settings import EdgeSettings
from meshkit import event_loop, telemetry
from meshkit.config import ServiceArgs

log = logging.getLogger("edge")

# Connections waiting to be accepted. Envoy opens few (HTTP/2), so this is for bursts of other clients.
LISTEN_BACKLOG = 1024
# After the drain's grace, how long the server may take to close what is left before the process exits
# anyway (a client that stopped reading keeps its response open).
CLOSE_MARGIN_S = 2.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EdgeSettings]:
    args = ServiceArgs("edge", "REST + SSE for browsers and the OpenAI-compatible API, over ChatService.")
    args.add("host", "127.0.0.1", "address to listen on")
    args.add("port", 8081, "HTTP port")
    args.add("metrics-port", 0, "Prometheus /metrics port (0: disabled)")
    args.add_config(EdgeSettings)
    return args.config(EdgeSettings, argv)


def http_server(app: ASGIApp, host: str, port: int, settings: EdgeSettings) -> Server:
    return Server(
        app,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        # HTTP/2 (prior knowledge) from Envoy, HTTP/1.1 from anyone else.
        http=HTTPModes.auto,
        backlog=LISTEN_BACKLOG,
        # granian's backpressure counts connections, not requests: HTTP/1.1 clients hold one per stream.
        backpressure=settings.max_connections,
        http2_settings=HTTP2Settings(max_concurrent_streams=settings.http2_max_streams),
        log_level=LogLevels.warning,
        log_access=False,  # Envoy writes the access log
    )


async def serve(server: Server, drain: Drain, drain_grace_s: float) -> None:
    """Serves until SIGTERM or SIGINT, then drains: the listener closes at once, open answer streams get
    ``drain_grace_s`` to finish (see Drain), and the process ends once they have."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop.set)
    try:
        await _serve_until(server, stop, drain, drain_grace_s)
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


async def _serve_until(server: Server, stop: asyncio.Event, drain: Drain, drain_grace_s: float) -> None:
    serving = asyncio.create_task(server.serve(), name="http-server")
    stopping = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait((serving, stopping), return_when=asyncio.FIRST_COMPLETED)
    if serving.done():  # the server ended on its own: a failure, raised here
        stopping.cancel()
        serving.result()
        return
    # Streams end half a second early, so their responses close cleanly before the cut-offs below.
    drain.start(max(0.0, drain_grace_s - 0.5))
    # sse-starlette's own cut-off (the responses' shutdown_grace_period) is the backstop for a stream
    # that ignores the drain.
    AppStatus.should_exit = True
    server.stop()
    try:
        await asyncio.wait_for(serving, drain_grace_s + CLOSE_MARGIN_S)
    except TimeoutError:
        log.warning(
            "edge: connections still open %.1f s after SIGTERM; exiting", drain_grace_s + CLOSE_MARGIN_S
        )


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    try:
        verifier = TokenVerifier.from_config(settings.identity)
    except ValueError as exc:
        sys.exit(f"python -m edge: {exc}")
    telemetry.setup("edge")
    telemetry.start_metrics_server(args.metrics_port, args.host)
    drain = Drain()
    server = http_server(create_app(settings, verifier, drain), args.host, args.port, settings)
    event_loop.run(serve(server, drain, settings.streams.drain_grace_s))


if __name__ == "__main__":
    main()
