"""The embedding engine's queue and its one compute thread: the inputs of every call waiting when a
batch ends go into the next batch together, higher priorities first, up to a token budget.

A call's inputs are queued one by one, so a call of many inputs spreads over several batches while a
short call of a higher priority can still take the next one; the call is answered once its last input
is computed. The thread owns the encoder (it runs one batch at a time); calls wait on an asyncio future
that the thread resolves through the loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from chatmesh.errors import exhausted
from engine.model.bert import BertEncoder

log = logging.getLogger(__name__)

# A queue that is full answers with this retry delay: a batch takes tens of milliseconds.
FULL_RETRY_S = 0.5


@dataclass(eq=False)
class _Call:
    vectors: np.ndarray  # [inputs, dim], filled as batches finish
    left: int  # inputs not computed yet
    future: asyncio.Future[np.ndarray]


@dataclass(order=True)
class _Item:
    priority: int  # negated: heapq pops the smallest
    order: int  # arrival, then position in the call
    call: _Call = field(compare=False)
    index: int = field(compare=False)
    token_ids: Sequence[int] = field(compare=False)


@dataclass
class BatchStats:
    """What the batcher has done, for load reports and metrics (read without a lock: ints only)."""

    waiting_calls: int = 0  # calls not answered yet
    batches: int = 0
    inputs: int = 0
    tokens: int = 0


class EmbeddingBatcher:
    def __init__(
        self,
        encoder: BertEncoder,
        loop: asyncio.AbstractEventLoop,
        max_batch_tokens: int,
        max_waiting_calls: int,
        on_batch=None,
    ) -> None:
        """``on_batch(inputs, tokens, seconds)``: called from the thread after each batch (metrics)."""
        self.encoder = encoder
        self.stats = BatchStats()
        self._loop = loop
        self._max_batch_tokens = max(max_batch_tokens, encoder.config.max_tokens)
        self._max_waiting_calls = max_waiting_calls
        self._on_batch = on_batch
        self._queue: list[_Item] = []
        self._arrivals = itertools.count()
        self._ready = threading.Condition()
        self._stopped = False
        self.failure = ""  # why the thread stopped computing, if it did
        self._thread = threading.Thread(target=self._run, name="embed-batches", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def submit(self, inputs: Sequence[Sequence[int]], priority: int) -> asyncio.Future[np.ndarray]:
        """Queues a call's inputs (checked token ids, specials included); its future gets float32
        ``[len(inputs), dim]``. Raises RESOURCE_EXHAUSTED when ``max_waiting_calls`` calls wait."""
        future: asyncio.Future[np.ndarray] = self._loop.create_future()
        call = _Call(
            np.empty((len(inputs), self.encoder.config.hidden_size), np.float32), len(inputs), future
        )
        with self._ready:
            if self.stats.waiting_calls >= self._max_waiting_calls:
                raise exhausted(
                    f"the embedding queue is full ({self._max_waiting_calls} calls waiting)", FULL_RETRY_S
                )
            self.stats.waiting_calls += 1
            for index, ids in enumerate(inputs):
                heapq.heappush(self._queue, _Item(-priority, next(self._arrivals), call, index, ids))
            self._ready.notify()
        return future

    def _take(self) -> list[_Item] | None:
        """The next batch: queued inputs in priority order while the token budget holds (always one)."""
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            if self._stopped:
                return None
            batch: list[_Item] = []
            tokens = 0
            while self._queue and (
                not batch or tokens + len(self._queue[0].token_ids) <= self._max_batch_tokens
            ):
                item = heapq.heappop(self._queue)
                batch.append(item)
                tokens += len(item.token_ids)
            return batch

    def _run(self) -> None:
        batch: list[_Item] = []
        try:
            while batch := self._take() or []:
                started = time.perf_counter()
                vectors = self.encoder.encode([item.token_ids for item in batch])
                tokens = sum(len(item.token_ids) for item in batch)
                self.stats.batches += 1
                self.stats.inputs += len(batch)
                self.stats.tokens += tokens
                if self._on_batch is not None:
                    self._on_batch(len(batch), tokens, time.perf_counter() - started)
                self._loop.call_soon_threadsafe(self._deliver, batch, vectors)
        except Exception as exc:  # a bug or out of memory: fail what waits, and say so (health)
            log.exception("the embedding thread failed")
            self.failure = f"the embedding model failed: {type(exc).__name__}"
            self._loop.call_soon_threadsafe(self._fail_all)

    def _deliver(self, batch: list[_Item], vectors: np.ndarray) -> None:
        """On the loop: each input's vector into its call; a call whose last input this was is answered."""
        for item, vector in zip(batch, vectors, strict=True):
            call = item.call
            call.vectors[item.index] = vector
            call.left -= 1
            if call.left == 0:
                with self._ready:
                    self.stats.waiting_calls -= 1
                if not call.future.done():  # the caller may have left
                    call.future.set_result(call.vectors)

    def _fail_all(self) -> None:
        with self._ready:
            items, self._queue = self._queue, []
            self._stopped = True
        for item in items:
            if not item.call.future.done():
                item.call.future.set_exception(RuntimeError(self.failure))
