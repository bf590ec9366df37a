"""What every part of the store shares: the checks of its callers' values, and small conversions."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, overload

from cassandra.query import UNSET_VALUE

from chatmesh.limits import Limits
from memory_store.errors import InvalidArgument
from memory_store.models import StoreBounds


def check_user(user_id: str, bounds: StoreBounds) -> str:
    if not user_id or len(user_id) > bounds.max_user_id_chars:
        raise InvalidArgument(f"user id must be 1..{bounds.max_user_id_chars} characters")
    return user_id


def check_idempotency_key(key: str, limits: Limits) -> None:
    if not 1 <= len(key) <= limits.max_idempotency_key_chars:
        raise InvalidArgument(f"idempotency key must be 1..{limits.max_idempotency_key_chars} characters")


def check_fingerprint(fingerprint: str, bounds: StoreBounds) -> str:
    """A stored count's tokenizer fingerprint ("" for unknown) is of bounded length."""
    if len(fingerprint) > bounds.max_fingerprint_chars:
        raise InvalidArgument(
            f"tokenizer fingerprint is longer than {bounds.max_fingerprint_chars} characters"
        )
    return fingerprint


def page_size(requested: int | None, default: int, maximum: int) -> int:
    if requested is None or requested == 0:
        return default
    if not 1 <= requested <= maximum:
        raise InvalidArgument(f"page size must be between 1 and {maximum}, got {requested}")
    return requested


def now() -> datetime:
    """The current UTC time at millisecond precision (what a CQL timestamp holds)."""
    current = datetime.now(UTC)
    return current.replace(microsecond=current.microsecond // 1000 * 1000)


def micros(at: datetime) -> int:
    """A datetime as microseconds since the epoch: a CQL write timestamp."""
    return int(at.timestamp()) * 1_000_000 + at.microsecond


@overload
def utc(value: datetime) -> datetime: ...
@overload
def utc(value: None) -> None: ...
def utc(value: datetime | None) -> datetime | None:
    """The driver returns naive UTC datetimes; the API speaks timezone-aware ones."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def unset(value: Any) -> Any:
    """None is left unset, never written as a null (which would be a tombstone)."""
    return UNSET_VALUE if value is None else value


def id_str(value: uuid.UUID | None) -> str | None:
    return str(value) if value is not None else None
