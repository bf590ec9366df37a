"""``python -m edge``: the HTTP/SSE edge in front of ChatService."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from types import FrameType

import uvicorn

from chatmesh.identity import TokenVerifier
from edge.app import create_app
from edge.drain import Drain
from edge.settings import EdgeSettings
from meshkit import event_loop, telemetry
from meshkit.config import ServiceArgs


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, EdgeSettings]:
    args = ServiceArgs("edge", "REST + SSE for browsers and the OpenAI-compatible API, over ChatService.")
    args.add("host", "127.0.0.1", "address to listen on")
    args.add("port", 8081, "HTTP port")
    args.add("metrics-port", 0, "Prometheus /metrics port (0: disabled)")
    args.add_config(EdgeSettings)
    return args.config(EdgeSettings, argv)


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT open answer streams get ``drain_grace_s`` to finish (see Drain)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_grace_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_grace_s = drain, drain_grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.drain.draining:
            # Streams end half a second early, so responses close cleanly before uvicorn's own cut-off.
            grace = max(0.0, self.drain_grace_s - 0.5)
            asyncio.get_running_loop().call_soon_threadsafe(self.drain.start, grace)
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    try:
        verifier = TokenVerifier.from_config(settings.identity)
    except ValueError as exc:
        sys.exit(f"python -m edge: {exc}")
    telemetry.setup("edge")
    telemetry.start_metrics_server(args.metrics_port, args.host)
    drain = Drain()
    config = uvicorn.Config(
        create_app(settings, verifier, drain),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=math.ceil(settings.streams.drain_grace_s),
        timeout_keep_alive=settings.keep_alive_s,
        http="httptools",  # C parsing and plain transport writes: less CPU per SSE event than h11
        loop=event_loop.chosen(),
        log_level="warning",
        access_log=False,  # Envoy writes the access log
        proxy_headers=False,
    )
    with event_loop.server_gc():
        DrainingServer(config, drain, settings.streams.drain_grace_s).run()


if __name__ == "__main__":
    main()
