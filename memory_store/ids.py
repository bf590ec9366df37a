"""Time-sortable ids: version-1 UUIDs, stored as CQL ``timeuuid`` (Cassandra orders them by time).

The writer chooses the id, so a retried write is an upsert of the same row, never a second row.
Ids carry 100 ns timestamps and 62 random bits (random "node" and clock sequence, as RFC 4122 allows
instead of a MAC address), so ids made on different replicas in the same instant do not collide.
Within one process, ids made "now" are strictly increasing.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from datetime import UTC, datetime

from memory_store.errors import InvalidArgument

# 100 ns intervals between the UUID epoch (1582-10-15) and the Unix epoch.
_UUID_EPOCH_OFFSET = 0x01B21DD213814000
_MULTICAST_BIT = 1 << 40  # marks a random node id (RFC 4122 section 4.5)

_lock = threading.Lock()
_last_ticks = 0


def _from_ticks(ticks: int) -> uuid.UUID:
    clock_seq = secrets.randbits(14)
    node = secrets.randbits(48) | _MULTICAST_BIT
    return uuid.UUID(
        fields=(
            ticks & 0xFFFFFFFF,
            (ticks >> 32) & 0xFFFF,
            ((ticks >> 48) & 0x0FFF) | 0x1000,
            ((clock_seq >> 8) & 0x3F) | 0x80,
            clock_seq & 0xFF,
            node,
        )
    )


def new_id(at: datetime | None = None) -> uuid.UUID:
    """A new time-sortable id for ``at`` (default: now, strictly increasing within this process)."""
    global _last_ticks
    if at is not None:
        return _from_ticks(round(at.timestamp() * 10_000_000) + _UUID_EPOCH_OFFSET)
    with _lock:
        ticks = max(time.time_ns() // 100 + _UUID_EPOCH_OFFSET, _last_ticks + 1)
        _last_ticks = ticks
    return _from_ticks(ticks)


def id_time(value: uuid.UUID) -> datetime:
    """When the id was made (UTC, microsecond precision)."""
    micros = (value.time - _UUID_EPOCH_OFFSET) // 10
    return datetime.fromtimestamp(micros // 1_000_000, UTC).replace(microsecond=micros % 1_000_000)


def id_micros(value: uuid.UUID) -> int:
    """The id's timestamp in microseconds since the Unix epoch (used as a CQL write timestamp)."""
    return (value.time - _UUID_EPOCH_OFFSET) // 10


def parse_id(text: str, what: str) -> uuid.UUID:
    """Parses a client-supplied id; anything but a time-based UUID is INVALID_ARGUMENT."""
    try:
        value = uuid.UUID(text)
    except (ValueError, TypeError, AttributeError):
        raise InvalidArgument(f"{what} {text!r} is not a valid id") from None
    if value.version != 1:
        raise InvalidArgument(f"{what} {text!r} is not a valid id")
    return value


def parse_optional_id(text: str | None, what: str) -> uuid.UUID | None:
    return parse_id(text, what) if text else None


def id_before(value: uuid.UUID, ticks: int) -> uuid.UUID:
    """The id ``ticks`` (of 100 ns) older than ``value``, with its clock sequence and node: a function of
    ``value``, so ids derived from one an idempotency key claimed are the same on every retry."""
    older = value.time - ticks
    return uuid.UUID(
        fields=(
            older & 0xFFFFFFFF,
            (older >> 32) & 0xFFFF,
            ((older >> 48) & 0x0FFF) | 0x1000,
            value.clock_seq_hi_variant,
            value.clock_seq_low,
            value.node,
        )
    )
