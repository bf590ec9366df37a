"""The prefix cache's change log: events numbered in per-step batches, a snapshot for resync, subscribers.

The block pool reports each change where it happens (``stored``/``removed``); the engine
calls ``flush`` once per step, which numbers the step's events as one batch (+1 each) and hands it to
every subscriber. The log keeps its own copy of the cached hash set as of the last batch, so a
snapshot and the batches after it always line up exactly, without locking the pool.

Subscribers are fed from the step thread and read from anywhere else: each has a bounded buffer, and
one that falls further behind than that is cut off (``SubscriberOverflow``) instead of slowing the
engine down or growing without bound; it resubscribes and starts again from a snapshot.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlocksStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None  # hash of the block before block_hashes[0]; None for a first block


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


KvEvent = BlocksStored | BlocksRemoved


@dataclass(frozen=True)
class KvEventBatch:
    sequence_number: int
    events: tuple[KvEvent, ...]


@dataclass(frozen=True)
class KvSnapshot:
    sequence_number: int  # the last batch already reflected; the next one is sequence_number + 1
    block_hashes: frozenset[int]


def apply_events(index: set[int], events: Iterable[KvEvent]) -> None:
    """Replays events into a set of cached hashes (what a router's per-engine index does)."""
    for event in events:
        if isinstance(event, BlocksStored):
            index.update(event.block_hashes)
        else:
            index.difference_update(event.block_hashes)


class SubscriberOverflow(Exception):
    """The subscriber fell more than its buffer behind; it must resubscribe from a fresh snapshot."""


class Subscription:
    """One subscriber's buffer of batches not yet taken."""

    def __init__(self, log: KvEventLog, notify: Callable[[], None], limit: int) -> None:
        self._log = log
        self._notify = notify
        self._limit = limit
        self._batches: deque[KvEventBatch] = deque()
        self._overflowed = False

    def take(self) -> list[KvEventBatch]:
        """Batches published since the last take, oldest first (possibly none)."""
        with self._log.lock:
            if self._overflowed:
                raise SubscriberOverflow(f"more than {self._limit} KV event batches behind")
            batches = list(self._batches)
            self._batches.clear()
        return batches

    def close(self) -> None:
        self._log.unsubscribe(self)

    def _offer(self, batch: KvEventBatch) -> bool:
        """Adds a batch (log lock held); True when the reader should be woken."""
        if self._overflowed:
            return False
        if len(self._batches) >= self._limit:
            self._overflowed = True
            self._batches.clear()
            return True
        self._batches.append(batch)
        return len(self._batches) == 1


class KvEventLog:
    def __init__(self, subscriber_buffer: int = 1024) -> None:
        self.lock = threading.Lock()
        self._subscriber_buffer = subscriber_buffer
        self._pending: list[KvEvent] = []  # this step's events; touched by the step thread only
        self._sequence_number = 0
        self._cached: set[int] = set()  # the cached hashes as of batch _sequence_number
        self._subscribers: list[Subscription] = []

    # -- recording (step thread) ---------------------------------------------------------------------

    def stored(self, block_hashes: list[int], parent_block_hash: int | None) -> None:
        if block_hashes:
            self._pending.append(BlocksStored(tuple(block_hashes), parent_block_hash))

    def removed(self, block_hashes: list[int]) -> None:
        if not block_hashes:
            return
        if self._pending and isinstance(last := self._pending[-1], BlocksRemoved):
            self._pending[-1] = BlocksRemoved(last.block_hashes + tuple(block_hashes))
        else:
            self._pending.append(BlocksRemoved(tuple(block_hashes)))

    def flush(self) -> KvEventBatch | None:
        """Publishes this step's events as the next batch; None (and no number used) if nothing changed."""
        if not self._pending:
            return None
        events, self._pending = tuple(self._pending), []
        with self.lock:
            self._sequence_number += 1
            batch = KvEventBatch(self._sequence_number, events)
            apply_events(self._cached, events)
            wake = [sub._notify for sub in self._subscribers if sub._offer(batch)]
        for notify in wake:
            notify()
        return batch

    # -- reading (any thread) ------------------------------------------------------------------------

    @property
    def sequence_number(self) -> int:
        return self._sequence_number

    def snapshot(self) -> KvSnapshot:
        with self.lock:
            return KvSnapshot(self._sequence_number, frozenset(self._cached))

    def subscribe(self, notify: Callable[[], None]) -> tuple[KvSnapshot, Subscription]:
        """A snapshot and a subscription whose first batch is the snapshot's sequence number + 1.

        ``notify`` is called from the step thread when the subscription goes from empty to non-empty
        or overflows; it must be quick and thread-safe (e.g. ``loop.call_soon_threadsafe``).
        """
        subscription = Subscription(self, notify, self._subscriber_buffer)
        with self.lock:
            snapshot = KvSnapshot(self._sequence_number, frozenset(self._cached))
            self._subscribers.append(subscription)
        return snapshot, subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self.lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)
