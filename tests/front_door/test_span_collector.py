"""The local mesh's OTLP receiver (localmesh/span_collector.py) over real gRPC: Envoy's spans land in the
span file as the same records the services write themselves (meshkit.telemetry.SpanRecord)."""

from __future__ import annotations

import json

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from localmesh.span_collector import serve
from meshkit.launcher import free_port
from meshkit.telemetry import SpanRecord


def _attribute(key: str, **value: object) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(**value))


def test_exported_spans_are_appended_as_span_records(tmp_path):
    path, port = tmp_path / "spans.jsonl", free_port()
    span = trace_pb2.Span(
        trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
        span_id=bytes.fromhex("b7ad6b7169203331"),
        name="ingress",
        kind=trace_pb2.Span.SPAN_KIND_SERVER,
        start_time_unix_nano=1_000,
        end_time_unix_nano=5_000,
        status=trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR),
        attributes=[_attribute("http.status_code", string_value="503"), _attribute("upstream", int_value=2)],
    )
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(attributes=[_attribute("service.name", string_value="envoy")]),
                scope_spans=[trace_pb2.ScopeSpans(spans=[span])],
            )
        ]
    )
    server = serve(port, str(path))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=5)
    finally:
        server.stop(None)
    [line] = path.read_text().splitlines()
    assert SpanRecord(**json.loads(line)) == SpanRecord(
        service="envoy",
        name="ingress",
        kind="SERVER",
        trace_id="0af7651916cd43dd8448eb211c80319c",
        span_id="b7ad6b7169203331",
        parent_span_id=None,  # a root span: OTLP sends no parent
        start_ns=1_000,
        end_ns=5_000,
        status="ERROR",
        attributes={"http.status_code": "503", "upstream": 2},
    )
