"""Prometheus metrics and OpenTelemetry spans for every HTTP request the edge serves.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer streaming responses).
The span continues the caller's W3C trace (the ``traceparent`` Envoy forwards) and stays current while
the handler runs, so the gRPC instrumentation carries it on to the orchestrator.
"""

from __future__ import annotations

import time

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import REGISTRY, CollectorRegistry
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshkit.metrics import ComponentMetrics


class EdgeMetrics(ComponentMetrics):
    component = "edge"

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(registry)
        self.http_requests = self.counter(
            "http_requests_total", "HTTP requests by route and status", ["method", "route", "status"]
        )
        self.http_duration = self.histogram(
            "http_request_duration_seconds",
            "Time from request to the end of the response (the whole stream for SSE)",
            ["method", "route"],
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.open_streams = self.gauge("open_streams", "SSE responses open now", ["kind"])
        self.stream_events = self.counter(
            "stream_events_total", "Run events relayed to clients", ["kind", "event"]
        )
        self.first_event = self.histogram(
            "time_to_first_delta_seconds",
            "From the request to the first text delta relayed (TTFT as the edge sees it)",
            ["kind"],
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        )


# The process's instance.
METRICS = EdgeMetrics()

tracer = trace.get_tracer("edge")


def route_name(scope: Scope) -> str:
    """The matched route's path template (bounded label values), or "unmatched"."""
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return getattr(route, "path", "unmatched") or "unmatched"
    return "unmatched"


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, route = scope["method"], route_name(scope)
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        status = 500
        started = time.monotonic()

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with tracer.start_as_current_span(
            f"{method} {route}", context=propagate.extract(headers), kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("http.request.method", method)
            span.set_attribute("http.route", route)
            try:
                await self.app(scope, receive, send_observed)
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                METRICS.http_requests.labels(method, route, str(status)).inc()
                METRICS.http_duration.labels(method, route).observe(time.monotonic() - started)
