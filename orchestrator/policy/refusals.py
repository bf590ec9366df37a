"""Refusals by a request limit, counted by the field at fault (the limits themselves are pure checks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from chatmesh.errors import ServiceError
from orchestrator.metrics import METRICS

T = TypeVar("T")


def refused(error: ServiceError) -> ServiceError:
    """Counts ``error`` as a limit refusal and returns it, to be raised."""
    METRICS.limit_rejections.labels(error.field or "request").inc()
    return error


def checked(check: Callable[..., T], *args: object) -> T:
    """Runs a limits check, counting what it refuses."""
    try:
        return check(*args)
    except ServiceError as error:
        raise refused(error) from None
