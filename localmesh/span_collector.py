"""``python -m localmesh.span_collector``: the local mesh's OTLP/gRPC trace receiver.

The Python services write their spans to the span file themselves (``CHATMESH_TRACE_FILE``,
meshkit/telemetry.py); Envoy can only export OTLP, so it sends its spans here and this appends them to
the same file, in the same format. The operations page (``/ops``) reads runs' traces from that file. Only
for ``make run``: in a cluster, point ``OTEL_EXPORTER_OTLP_ENDPOINT`` at an OpenTelemetry Collector.
"""

from __future__ import annotations

import argparse
import sys
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from meshkit.telemetry import SpanRecord, append_spans


def _value(value: common_pb2.AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    return None  # kvlist and bytes: not in any span the mesh emits


def _attributes(pairs: list[common_pb2.KeyValue]) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


def records(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanRecord]:
    """The request's spans as span-file records."""
    found = []
    for resource_spans in request.resource_spans:
        service = _attributes(list(resource_spans.resource.attributes)).get("service.name")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    SpanRecord(
                        service=str(service) if service is not None else None,
                        name=span.name,
                        kind=trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        status=trace_pb2.Status.StatusCode.Name(span.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        attributes=_attributes(list(span.attributes)),
                    )
                )
    return found


class SpanFileCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path: str) -> None:
        self.path = path

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        append_spans(self.path, records(request))
        return trace_service_pb2.ExportTraceServiceResponse()


def serve(port: int, path: str, host: str = "127.0.0.1") -> grpc.Server:
    # One worker: writes to the file stay in order and never interleave.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(SpanFileCollector(path), server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localmesh.span_collector", description=__doc__)
    parser.add_argument("--port", type=int, default=4317, help="OTLP/gRPC port")
    parser.add_argument("--file", required=True, help="span file to append to (JSON lines)")
    args = parser.parse_args(argv)
    serve(args.port, args.file).wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
