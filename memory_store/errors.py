"""Typed errors of the memory store, each naming the gRPC status code it means.

memory_store does not import grpc: every error carries ``code``, the name of a ``grpc.StatusCode``
member, and the orchestrator maps it in one place (``grpc.StatusCode[exc.code]``). Messages are safe to
show to clients: they name the limit or the missing thing, never CQL or a stack trace.
"""

from __future__ import annotations

from typing import ClassVar


class MemoryStoreError(Exception):
    """Base class. ``code`` is a ``grpc.StatusCode`` member name."""

    code: ClassVar[str] = "INTERNAL"


class InvalidArgument(MemoryStoreError):
    """Malformed id or cursor, or a limit exceeded (content size, page size, title length, ...)."""

    code = "INVALID_ARGUMENT"


class NotFound(MemoryStoreError):
    """No such chat, message or run for this user. Another user's data is reported the same way."""

    code = "NOT_FOUND"


class AlreadyExists(MemoryStoreError):
    """The thing was already created with different contents (e.g. an id reused for another run)."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(MemoryStoreError):
    """The request conflicts with stored state (e.g. a message's parent is newer than the message)."""

    code = "FAILED_PRECONDITION"


class OwnerChanged(FailedPrecondition):
    """The run is owned by another replica now (it adopted the run from one it took for dead)."""


class Unavailable(MemoryStoreError):
    """Cassandra did not answer in time or too few replicas are up. Safe to retry with backoff."""

    code = "UNAVAILABLE"
