"""What every part of the store shares: the session, the config, cursors, and small conversions."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import UTC, datetime
from typing import Any, overload

from cassandra.query import UNSET_VALUE

from chatmesh.limits import Limits
from memory_store.config import StoreConfig
from memory_store.cursor import CursorCodec
from memory_store.db import Db, Row
from memory_store.errors import InvalidArgument, Unavailable
from memory_store.models import StoreBounds

# How many times a conditional write on one key is tried while it times out (``StoreBase._contended``).
_CONTENDED_ATTEMPTS = 6


class StoreBase:
    """State shared by the parts of ``MemoryStore`` (chats, messages, runs, usage)."""

    def __init__(self, db: Db, config: StoreConfig, cursors: CursorCodec) -> None:
        self._db = db
        self._config = config
        self._cursors = cursors

    @property
    def limits(self) -> Limits:
        return self._config.limits

    @property
    def bounds(self) -> StoreBounds:
        return self._config.bounds

    def _check_user(self, user_id: str) -> str:
        if not user_id or len(user_id) > self.bounds.max_user_id_chars:
            raise InvalidArgument(f"user id must be 1..{self.bounds.max_user_id_chars} characters")
        return user_id

    def _check_fingerprint(self, fingerprint: str) -> str:
        """A stored count's tokenizer fingerprint ("" for unknown) is of bounded length."""
        if len(fingerprint) > self.bounds.max_fingerprint_chars:
            raise InvalidArgument(
                f"tokenizer fingerprint is longer than {self.bounds.max_fingerprint_chars} characters"
            )
        return fingerprint

    def _check_idempotency_key(self, key: str) -> None:
        if not 1 <= len(key) <= self.limits.max_idempotency_key_chars:
            raise InvalidArgument(
                f"idempotency key must be 1..{self.limits.max_idempotency_key_chars} characters"
            )

    async def _contended(self, name: str, params: tuple[Any, ...]) -> Row:
        """A conditional write on one key, run again while it times out (contention on the key, or a
        slow node): its outcome is then unknown, so each statement run this way must recognise its own
        write in the row a later attempt gets back."""
        for attempt in range(_CONTENDED_ATTEMPTS - 1):
            try:
                return (await self._db.execute(name, params))[0]
            except Unavailable:
                await asyncio.sleep(random.uniform(0.01, 0.05) * 2**attempt)
        return (await self._db.execute(name, params))[0]

    def _page_size(self, requested: int | None, default: int, maximum: int) -> int:
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
