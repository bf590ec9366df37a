"""What every kind of run is: an answer being generated, from its request to its stored end, as one
task of the replica.

Each kind is a class whose ``execute`` reads top to bottom (``send.py``, ``regenerate.py``,
``complete.py``). Its constructor checks the request (limits, input moderation) before any read or
write, so a refusal costs nothing; ``execute`` then calls the shared steps of ``starts.Starts``.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from typing import ClassVar

import grpc

from chatmesh.errors import ServiceError
from chatmesh.identity import Identity
from orchestrator.runs.held_run import HeldRun


class AnswerRun(ABC):
    kind: ClassVar[str]
    # Whether the run goes on when the caller that started it goes away (else it is cancelled).
    outlives_caller: ClassVar[bool]

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        # When the request arrived, for time to first token.
        self.arrived_at = time.monotonic()
        # Set to the run id once the run is live (or joined an earlier one), or to the refusal that
        # ended it before (``Starts.start`` waits for it).
        self.started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.started.add_done_callback(_observe_refusal)
        # The run this request started, once live (None while starting, and for one that joined an
        # earlier attempt's run).
        self.live: HeldRun | None = None

    @property
    def idempotency_key(self) -> str:
        """Duplicates with the same key join one run (empty: every request is a run of its own)."""
        return ""

    @property
    def fingerprint(self) -> bytes:
        """What tells a duplicate with the same key from another request reusing it."""
        return b""

    @abstractmethod
    async def execute(self) -> None:
        """The whole run, step by step: raises a refusal before it is live."""

    async def abandoned(self) -> None:
        """Undoes what the run holds outside this replica when it is refused before going live."""
        return  # Complete holds nothing outside the replica


def key_reused() -> ServiceError:
    """The answer to a request whose idempotency key an earlier, different request used."""
    return ServiceError(
        grpc.StatusCode.ALREADY_EXISTS,
        "this idempotency key was already used for a different request; use a new key for a new message",
    )


def _observe_refusal(started: asyncio.Future[str]) -> None:
    # A refusal nobody waits for any more (the caller left) must not be reported as never retrieved.
    if not started.cancelled():
        started.exception()
