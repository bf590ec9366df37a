"""``python -m edge``: the HTTP/SSE edge in front of ChatService."""

from __future__ import annotations

import uvicorn

from chatmesh import telemetry
from chatmesh.config import ServiceArgs
from edge.app import create_app
from edge.settings import EdgeSettings
from edge.sse import StreamSettings


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    telemetry.setup("edge")
    telemetry.start_metrics_server(args.metrics_port, args.host)
    uvicorn.run(
        create_app(settings_from(args)),
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.drain_grace_s,
        log_level="warning",
        access_log=False,  # Envoy writes the access log
        proxy_headers=False,
    )


if __name__ == "__main__":
    main()
