"""Which engine holds which KV block: ``block hash → engines``, fed only by the engines' KV events.

Block hashes are chained (``chatmesh.block_hash``): a hash names a whole prefix, so a flat map does
what a radix tree over tokens would, and a request's cached prefix on an engine is the leading run of
its block hashes that the engine holds. Engines are bits of an int per hash, so one lookup per block
answers for every engine at once. A block held by one engine (most are: a chat's history lives on one)
is stored as ``~slot``, a small negative int, rather than as a mask as wide as the fleet (a 1,000-bit
int is 160 bytes); blocks held by several engines (system prompts) are masks.

``leading_blocks`` answers for every engine at once as an array by slot (what placement reads, so a
decision over a thousand engines stays a few vector operations); ``match`` is the same by engine name.

Nothing is guessed: a block enters the index when its engine says it stored it and leaves when the
engine says it evicted it (or when the engine's stream breaks: then everything of that engine goes
until a fresh snapshot). Memory is bounded per engine by ``max_blocks`` (the engine's own pool size
caps what a correct engine can report); blocks beyond the bound are not indexed, which only costs
affinity, never correctness.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from itertools import filterfalse, islice

import numpy as np


class PrefixIndex:
    def __init__(self) -> None:
        self._engines: dict[int, int] = {}  # block hash → ~slot of its one holder, or a bitmask of slots
        self._blocks: dict[str, set[int]] = {}  # engine → hashes it holds
        self._slots: dict[str, int] = {}  # engine → its bit
        self._held: dict[int, set[int]] = {}  # slot → the hashes its engine holds (the same sets)
        self._limits: dict[str, int] = {}
        self.dropped = 0  # stored blocks not indexed because their engine was at its bound

    def add_engine(self, engine_id: str, max_blocks: int) -> None:
        """Makes ``engine_id`` indexable (holding nothing yet), with at most ``max_blocks`` entries."""
        if engine_id not in self._slots:
            used = set(self._slots.values())
            slot = self._slots[engine_id] = next(slot for slot in range(len(used) + 1) if slot not in used)
            self._blocks[engine_id] = self._held[slot] = set()
        self._limits[engine_id] = max_blocks

    def remove_engine(self, engine_id: str) -> None:
        self.clear(engine_id)
        self._blocks.pop(engine_id, None)
        self._held.pop(self._slots.pop(engine_id, -1), None)
        self._limits.pop(engine_id, None)

    def store(self, engine_id: str, block_hashes: Iterable[int]) -> None:
        held = self._blocks[engine_id]
        slot = self._slots[engine_id]
        bit = 1 << slot
        room = self._limits[engine_id] - len(held)
        for block_hash in block_hashes:
            if block_hash in held:
                continue
            if room <= 0:
                self.dropped += 1
                continue
            held.add(block_hash)
            holders = self._engines.get(block_hash)
            self._engines[block_hash] = ~slot if holders is None else _pack(_mask(holders) | bit)
            room -= 1

    def remove(self, engine_id: str, block_hashes: Iterable[int]) -> None:
        held = self._blocks[engine_id]
        keep = ~(1 << self._slots[engine_id])
        for block_hash in block_hashes:
            if block_hash in held:
                held.discard(block_hash)
                self._drop_bits(block_hash, keep)

    def clear(self, engine_id: str) -> None:
        """Forgets everything ``engine_id`` held (stream broken, cache cleared, before a snapshot)."""
        held = self._blocks.get(engine_id)
        if not held:
            return
        keep = ~(1 << self._slots[engine_id])
        for block_hash in held:
            self._drop_bits(block_hash, keep)
        held.clear()

    def replace(self, engine_id: str, block_hashes: Iterable[int]) -> None:
        """Sets what ``engine_id`` holds to exactly ``block_hashes`` (a snapshot)."""
        self.clear(engine_id)
        self.store(engine_id, block_hashes)

    def _drop_bits(self, block_hash: int, keep: int) -> None:
        remaining = _mask(self._engines[block_hash]) & keep
        if remaining:
            self._engines[block_hash] = _pack(remaining)
        else:
            del self._engines[block_hash]

    def size(self, engine_id: str) -> int:
        return len(self._blocks.get(engine_id, ()))

    def footprint_bytes(self) -> int:
        """Bytes the index holds: its maps and sets, the engine bitmasks, and one hash int per entry (each
        event's hashes arrive as new ints). Walks every entry: for capacity figures, not the serving path."""
        sets = sum(sys.getsizeof(held) + sum(map(sys.getsizeof, held)) for held in self._blocks.values())
        return sys.getsizeof(self._engines) + sum(map(sys.getsizeof, self._engines.values())) + sets

    def slot(self, engine_id: str) -> int:
        """The engine's row in ``leading_blocks``'s answer (stable while the engine is indexed)."""
        return self._slots[engine_id]

    def slots(self) -> int:
        """One more than the highest slot in use: the length ``leading_blocks`` needs at least."""
        return max(self._slots.values(), default=-1) + 1

    def leading_blocks(self, block_hashes: Sequence[int], size: int) -> np.ndarray:
        """For every slot below ``size``: how many leading ``block_hashes`` its engine holds."""
        depth = np.zeros(size, dtype=np.int64)
        alive = (1 << size) - 1
        engines, previous = self._engines, None
        for position, block_hash in enumerate(block_hashes):
            holders = engines.get(block_hash, 0)
            if holders == previous:  # a shared prefix's blocks mostly have one set of holders: none drop out
                continue
            previous = holders
            still = alive & (1 << ~holders if holders < 0 else holders)
            if still != alive:
                if position:  # engines that drop out here hold ``position`` blocks (0 is the default)
                    depth[_members(alive & ~still, size)] = position
                alive = still
                if not alive:
                    return depth
                if not alive & (alive - 1):  # one engine left (a chat's history): follow it cheaply
                    return self._follow(block_hashes, position + 1, alive.bit_length() - 1, depth)
        depth[_members(alive, size)] = len(block_hashes)
        return depth

    def _follow(self, block_hashes: Sequence[int], start: int, slot: int, depth: np.ndarray) -> np.ndarray:
        """The rest of the walk for one engine: the first block it lacks, found by set lookups that run
        in C. Its position is its value's first from ``start`` on: an earlier one would have been
        found missing first."""
        missing = next(filterfalse(self._held[slot].__contains__, islice(block_hashes, start, None)), None)
        depth[slot] = len(block_hashes) if missing is None else block_hashes.index(missing, start)
        return depth

    def match(self, block_hashes: Sequence[int], engine_ids: Iterable[str]) -> dict[str, int]:
        """For each of ``engine_ids``: how many leading ``block_hashes`` it holds (its cached prefix)."""
        known = [engine_id for engine_id in engine_ids if engine_id in self._slots]
        depth = self.leading_blocks(block_hashes, self.slots())
        return {engine_id: int(depth[self._slots[engine_id]]) for engine_id in known}


def _mask(holders: int) -> int:
    return 1 << ~holders if holders < 0 else holders


def _pack(mask: int) -> int:
    """``~slot`` for a mask of one engine, else the mask."""
    return ~(mask.bit_length() - 1) if mask & (mask - 1) == 0 else mask


def _members(mask: int, size: int) -> np.ndarray:
    """Which of the ``size`` slots ``mask`` sets, as a boolean array (an index array costs a nonzero more)."""
    packed = np.frombuffer(mask.to_bytes((size + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(packed, count=size, bitorder="little").view(bool)
