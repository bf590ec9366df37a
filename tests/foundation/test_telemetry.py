"""meshkit.telemetry's filter of OpenTelemetry's cross-context detach alarm: the alarm itself, reproduced
with OpenTelemetry's own context API, is dropped; any other detach failure is still logged."""

from __future__ import annotations

import contextvars
import logging

import pytest
from opentelemetry import context as otel_context

from meshkit.telemetry import CrossContextDetach


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
