"""Logging, OpenTelemetry tracing and Prometheus metrics, set up the same way in every service.

Traces: W3C trace context crosses every gRPC hop through the OpenTelemetry gRPC instrumentation, and
with each request on a stream that carries many (``request_span``, ``trace_context``).
Spans are exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, and appended as JSON lines
to ``CHATMESH_TRACE_FILE`` when that is set (how tests check that one trace spans every service). With
neither, no span is recorded (OpenTelemetry's no-op tracer): a recorded span costs 24-31 µs of CPU
and an unrecorded one ~7 µs (measured here), a send makes ~15 in the orchestrator alone, and with
nowhere to send them they were recorded for nothing; a caller's trace context still crosses every hop. Which traces are recorded follows ``OTEL_TRACES_SAMPLER`` (default: every one;
``parentbased_traceidratio`` with ``OTEL_TRACES_SAMPLER_ARG=0.01`` keeps 1 % at a fleet's rates).
Metrics: each service defines its own Prometheus metrics (named after the OpenTelemetry GenAI semantic
conventions) and exposes them on ``--metrics-port``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

TRACE_FILE_ENV = "CHATMESH_TRACE_FILE"
# The RPCs that carry many requests on one stream (engine.v1's and router.v1's GenerateMany, chat.v1's
# CompleteMany): traced per request.
SHARED_STREAM_METHODS = ("GenerateMany", "CompleteMany")
HEALTH_SERVICE = "grpc.health.v1.Health"
_configured = False
_requests_tracer = trace.get_tracer("chatmesh.requests")


@dataclass(frozen=True)
class SpanRecord:
    """One finished span, one JSON line of the span file: what the services' exporter below and the local
    mesh's OTLP collector (Envoy's spans) write, and what the edge's operations page reads back."""

    service: str | None
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, PRODUCER, CONSUMER
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None
    start_ns: int | None
    end_ns: int | None
    status: str  # UNSET, OK, ERROR
    attributes: dict[str, object]

    def line(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"


def append_spans(path: str, records: Sequence[SpanRecord]) -> None:
    """Appends ``records`` to the span file in one write (processes share the file; O_APPEND keeps each
    write whole)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(record.line() for record in records))


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file shared by all local services."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        records = []
        for span in spans:
            ctx = span.get_span_context()
            if ctx is None:  # only spans that never started lack one; none reach an exporter
                continue
            records.append(
                SpanRecord(
                    service=str(span.resource.attributes.get("service.name")),
                    name=span.name,
                    kind=span.kind.name,
                    trace_id=f"{ctx.trace_id:032x}",
                    span_id=f"{ctx.span_id:016x}",
                    parent_span_id=f"{span.parent.span_id:016x}" if span.parent else None,
                    start_ns=span.start_time,
                    end_ns=span.end_time,
                    status=span.status.status_code.name,
                    attributes={k: _jsonable(v) for k, v in (span.attributes or {}).items()},
                )
            )
        with self._lock:
            append_spans(self._path, records)
        return SpanExportResult.SUCCESS


def _jsonable(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


class CrossContextDetach(logging.Filter):
    """Drops one known false alarm of OpenTelemetry's: "Failed to detach context" when a streaming
    call's handler (wrapped by the gRPC instrumentation) is closed from another asyncio context. That
    happens when a client cancels a stream while its handler waits on a write: the abandoned generator
    is finalized later, in a task of its own, where the token it attached cannot be reset
    (open-telemetry/opentelemetry-python-contrib#2357, open). The span still ends; only the log is
    wrong: two ERROR tracebacks per cancelled stream under load, 400 for 200 streams a benchmark closed."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage() == "Failed to detach context"
            and isinstance(error, ValueError)
            and "was created in a different Context" in str(error)
        )


def setup(service_name: str) -> None:
    """Configures logging and tracing for this process (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    logging.basicConfig(
        level=os.environ.get("CHATMESH_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s {service_name} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("opentelemetry.context").addFilter(CrossContextDetach())
    otlp_endpoint, trace_file = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), os.environ.get(TRACE_FILE_ENV)
    if otlp_endpoint or trace_file:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if trace_file:
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
        trace.set_tracer_provider(provider)

    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        filters,
    )

    # A stream that carries many requests lives as long as the link: a span of its own would never end.
    # Each of its requests gets its own span instead (request_span). Health checks are not traced: they
    # are noise in every trace store, and the instrumentation wraps a streaming handler as an async
    # generator, which the health service's Watch (a coroutine that writes) is not: every Watch failed.
    traced = filters.negate(
        filters.any_of(
            *(filters.method_name(method) for method in SHARED_STREAM_METHODS),
            filters.service_prefix(HEALTH_SERVICE),
        )
    )
    GrpcAioInstrumentorServer(filter_=traced).instrument()
    GrpcAioInstrumentorClient(filter_=traced).instrument()


def request_span(name: str, kind: trace.SpanKind, carrier: Mapping[str, str] | None = None) -> trace.Span:
    """A span for one request on a stream shared by many (``GenerateMany``, ``CompleteMany``), where the gRPC
    instrumentation cannot make one per request: a SERVER span continues the caller's trace context
    from ``carrier``, a CLIENT span the current context. The caller ends it when the request ends."""
    context = propagate.extract(carrier) if carrier is not None else None
    return _requests_tracer.start_span(name, context=context, kind=kind)


def trace_context(span: trace.Span) -> dict[str, str]:
    """W3C trace context of ``span`` (``traceparent``, ``tracestate``), to travel with its request."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def start_metrics_server(port: int, host: str = "127.0.0.1") -> None:
    """Serves Prometheus metrics at http://host:port/metrics (port 0 disables it)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)
