"""The collectives a rank's forward needs: sum partial activations, gather vocab-parallel logits.

``SingleRank`` is the identity (one process holds the whole model). ``ShmCollective`` works over one
shared-memory segment that every rank maps, with the futex barrier of ``kernels/tp_barrier.c``:

    all_reduce:     write my partial [T, hidden] into my slot → barrier → sum the slots in rank order
    gather_logits:  write my vocab columns of [rows, vocab] → barrier → rank 0 copies the whole matrix

Every rank sums the slots in the same order, so all ranks hold bit-identical activations after each
all-reduce. The reduce slots are double-buffered, so one barrier per all-reduce suffices: a rank can only
write buffer b again two all-reduces later, after every rank has passed the barrier that follows its
reads of b.

The segment is a memfd (an anonymous file): it never appears in /dev/shm, ranks receive its descriptor
over their pipe, and the kernel frees it with the last mapping, so no crash can leak it. It grows when a
step needs more rows than it holds; rank 0 then sends every rank the new descriptor before the step.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.model.tp.plan import Span

_BARRIER_BYTES = 4096  # the barrier words, then the data areas page-aligned
# How long a rank waits in a barrier before checking that its peers are still alive.
PEER_CHECK_INTERVAL_MS = 100


class Collective(Protocol):
    def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        """The sum of every rank's ``partial`` (float32 [T, hidden]); identical on every rank."""
        ...

    def gather_logits(self, local: np.ndarray, vocab: Span) -> np.ndarray | None:
        """Rank 0: the full [rows, vocab_size] logits from every rank's ``local`` columns; others: None."""
        ...


class SingleRank:
    def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        return partial

    def gather_logits(self, local: np.ndarray, vocab: Span) -> np.ndarray | None:
        return local


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed; the group cannot compute any more."""


@dataclass(frozen=True)
class Capacity:
    tokens: int  # rows of one step's activations
    logit_rows: int

    def covers(self, tokens: int, logit_rows: int) -> bool:
        return tokens <= self.tokens and logit_rows <= self.logit_rows

    def grown_to(self, tokens: int, logit_rows: int) -> Capacity:
        return Capacity(max(self.tokens, _pow2(tokens)), max(self.logit_rows, _pow2(logit_rows)))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def segment_bytes(world_size: int, hidden: int, vocab: int, capacity: Capacity) -> int:
    reduce = 2 * world_size * capacity.tokens * hidden * 4
    return _BARRIER_BYTES + reduce + capacity.logit_rows * vocab * 4


def create_segment(size: int) -> int:
    """A fresh zero-filled memfd of ``size`` bytes (pages are allocated as they are first written)."""
    fd = os.memfd_create("chatmesh-tp", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


class ShmCollective:
    """One rank's side of the group. ``check_peers`` raises ``RankFailure`` when a peer is gone; it runs
    whenever a barrier has waited ``PEER_CHECK_INTERVAL_MS`` without completing."""

    def __init__(
        self, lib, world_size: int, rank: int, hidden: int, vocab: int, check_peers: Callable[[], None]
    ) -> None:
        self._lib = lib
        self.world_size, self.rank = world_size, rank
        self._hidden, self._vocab = hidden, vocab
        self._check_peers = check_peers
        self._map: mmap.mmap | None = None
        self.capacity = Capacity(0, 0)
        self._turn = 0

    def attach(self, fd: int, capacity: Capacity) -> None:
        """Maps the segment in ``fd`` (and closes ``fd``), replacing the current one."""
        self.close()
        size = segment_bytes(self.world_size, self._hidden, self._vocab, capacity)
        self._map = mmap.mmap(fd, size)
        os.close(fd)
        world, hidden = self.world_size, self._hidden
        reduce_count = 2 * world * capacity.tokens * hidden
        self._barrier_ptr = np.frombuffer(self._map, np.uint8, _BARRIER_BYTES).ctypes.data
        self._reduce = np.frombuffer(self._map, np.float32, reduce_count, _BARRIER_BYTES).reshape(
            2, world, capacity.tokens, hidden
        )
        self._logits = np.frombuffer(
            self._map, np.float32, capacity.logit_rows * self._vocab, _BARRIER_BYTES + reduce_count * 4
        ).reshape(capacity.logit_rows, self._vocab)
        self.capacity = capacity
        self._turn = 0

    def all_reduce(self, partial: np.ndarray) -> np.ndarray:
        rows = len(partial)
        slots = self._reduce[self._turn]
        self._turn ^= 1
        slots[self.rank, :rows] = partial
        self.barrier()
        total = slots[0, :rows].copy()
        for r in range(1, self.world_size):
            total += slots[r, :rows]
        return total

    def gather_logits(self, local: np.ndarray, vocab: Span) -> np.ndarray | None:
        rows = len(local)
        self._logits[:rows, vocab.as_slice()] = local
        self.barrier()
        return self._logits[:rows].copy() if self.rank == 0 else None

    def barrier(self) -> None:
        generation = self._lib.cm_tp_arrive(self._barrier_ptr, self.world_size)
        while self._lib.cm_tp_wait(self._barrier_ptr, generation, PEER_CHECK_INTERVAL_MS):
            self._check_peers()

    def close(self) -> None:
        if self._map is None:
            return
        # The numpy views export the mapping's buffer: drop them before closing it.
        del self._reduce, self._logits
        self._map.close()
        self._map = None
