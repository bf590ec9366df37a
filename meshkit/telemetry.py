"""Logging, OpenTelemetry tracing and Prometheus metrics, set up the same way in every service.

Traces: W3C trace context crosses every gRPC hop through the OpenTelemetry gRPC instrumentation.
Spans are exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, and appended as JSON lines
to ``CHATMESH_TRACE_FILE`` when that is set (how tests check that one trace spans every service).
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
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

TRACE_FILE_ENV = "CHATMESH_TRACE_FILE"
_configured = False


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


def setup(service_name: str, level: str | None = None) -> None:
    """Configures logging and tracing for this process (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    logging.basicConfig(
        level=(level or os.environ.get("CHATMESH_LOG_LEVEL", "INFO")).upper(),
        format=f"%(asctime)s %(levelname)s {service_name} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file := os.environ.get(TRACE_FILE_ENV):
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    trace.set_tracer_provider(provider)

    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer

    GrpcAioInstrumentorServer().instrument()
    GrpcAioInstrumentorClient().instrument()


def start_metrics_server(port: int, host: str = "127.0.0.1") -> None:
    """Serves Prometheus metrics at http://host:port/metrics (port 0 disables it)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)
