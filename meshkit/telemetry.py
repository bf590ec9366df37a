"""Logging, OpenTelemetry tracing and Prometheus metrics, set up the same way in every service.

Traces: W3C trace context crosses every gRPC hop through the OpenTelemetry gRPC instrumentation.
Spans are exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, and appended as JSON lines
to ``CHATMESH_TRACE_FILE`` when that is set (how tests check that one trace spans every service).
Metrics: each service defines its own Prometheus metrics (named after the OpenTelemetry GenAI semantic
conventions) and exposes them on ``--metrics-port``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Sequence

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


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file shared by all local services."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            if ctx is None:  # only spans that never started lack one; none reach an exporter
                continue
            lines.append(
                json.dumps(
                    {
                        "service": span.resource.attributes.get("service.name"),
                        "name": span.name,
                        "kind": span.kind.name,
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "status": span.status.status_code.name,
                        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
                    }
                )
            )
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
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
