"""``python -m edge``: the HTTP/SSE edge in front of ChatService."""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

from edge.app import create_app
from edge.settings import EdgeSettings
from edge.sse import Drain, StreamSettings
from meshkit import telemetry
from meshkit.config import ServiceArgs


def parse_args(argv: list[str] | None = None):
    args = ServiceArgs("edge", "REST + SSE for browsers and the OpenAI-compatible API, over ChatService.")
    args.add("host", "127.0.0.1", "address to listen on")
    args.add("port", 8081, "HTTP port")
    args.add("metrics-port", 0, "Prometheus /metrics port (0: disabled)")
    args.add(
        "orchestrator",
        "127.0.0.1:50050",
        "ChatService address host:port (orchestrator or Envoy's internal listener)",
    )
    args.add("unary-timeout-s", 10.0, "deadline of each unary ChatService call")
    args.add("stream-timeout-s", 3600.0, "longest a single answer stream may stay open")
    args.add("max-body-bytes", 1024 * 1024, "largest request body accepted (413 above it)")
    args.add("sse-ping-s", 15.0, "seconds between SSE keep-alive comments on a quiet stream")
    args.add("drain-grace-s", 10.0, "seconds open streams get to finish after SIGTERM (then clients resume)")
    return args.parse(argv)


def settings_from(args) -> EdgeSettings:
    return EdgeSettings(
        orchestrator=args.orchestrator,
        unary_timeout_s=args.unary_timeout_s,
        stream_timeout_s=args.stream_timeout_s,
        max_body_bytes=args.max_body_bytes,
        streams=StreamSettings(ping_s=args.sse_ping_s, drain_grace_s=args.drain_grace_s),
    )


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
    args = parse_args(argv)
    telemetry.setup("edge")
    telemetry.start_metrics_server(args.metrics_port, args.host)
    drain = Drain()
    config = uvicorn.Config(
        create_app(settings_from(args), drain),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.drain_grace_s,
        log_level="warning",
        access_log=False,  # Envoy writes the access log
        proxy_headers=False,
    )
    DrainingServer(config, drain, args.drain_grace_s).run()


if __name__ == "__main__":
    main()
