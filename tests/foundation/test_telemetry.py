"""meshkit.telemetry: with no place to send spans none is recorded, yet a caller's trace context still
goes on to the next hop; with one, spans are recorded there. And its filter of OpenTelemetry's
cross-context detach alarm: the alarm itself, reproduced with OpenTelemetry's own context API, is
dropped; any other detach failure is still logged."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import context as otel_context

from meshkit.telemetry import TRACE_FILE_ENV, CrossContextDetach

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
# A service's setup, then a span under a caller's trace context, as a gRPC server span is made, and the
# context a call to the next hop would carry.
SERVICE = f"""
import json
from opentelemetry import propagate, trace
from meshkit import telemetry
telemetry.setup("probe")
caller = propagate.extract({{"traceparent": "00-{CALLER_TRACE}-b7ad6b7169203331-01"}})
with trace.get_tracer("probe").start_as_current_span("handler", context=caller) as span:
    onward = {{}}
    propagate.inject(onward)
    recording = span.is_recording()
print(json.dumps({{"recording": recording, "onward": onward["traceparent"]}}))
"""


def run_service(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in (TRACE_FILE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT")}
    done = subprocess.run(
        [sys.executable, "-c", SERVICE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_with_nowhere_to_send_spans_none_is_recorded_and_the_callers_trace_goes_on() -> None:
    probe = run_service()
    assert probe["recording"] is False
    assert probe["onward"].split("-")[1] == CALLER_TRACE


def test_with_a_span_file_spans_are_recorded_in_the_callers_trace(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    probe = run_service(**{TRACE_FILE_ENV: str(spans)})
    assert probe["recording"] is True
    assert probe["onward"].split("-")[1] == CALLER_TRACE
    [handler] = [json.loads(line) for line in spans.read_text().splitlines()]
    assert (handler["name"], handler["trace_id"], handler["service"]) == ("handler", CALLER_TRACE, "probe")


@pytest.fixture
def filtered(caplog):
    logger = logging.getLogger("opentelemetry.context")
    quiet = CrossContextDetach()
    logger.addFilter(quiet)
    caplog.set_level(logging.ERROR, logger="opentelemetry.context")
    yield caplog
    logger.removeFilter(quiet)


def test_a_token_detached_in_another_context_logs_nothing(filtered):
    token = otel_context.attach(otel_context.set_value("k", "v"))
    contextvars.copy_context().run(otel_context.detach, token)  # what a generator finalized elsewhere does
    assert filtered.records == []


def test_other_detach_failures_are_still_logged(filtered):
    otel_context.detach("not a token")
    assert [record.getMessage() for record in filtered.records] == ["Failed to detach context"]
