"""The fixed pool of KV blocks: ref counts, the prefix-cache hash map, and the LRU queue of free blocks.

A block is *used* while some sequence references it (ref count > 0), and *free* otherwise. A free block
may still be *cached*: it keeps its hash and its KV, and a later request with the same prefix takes it
back out of the free queue instead of recomputing. Allocation takes free blocks from the front of the
queue, evicting their cached hash; released blocks without a hash go to the front (they are worthless),
cached ones to the back (most recently used), so the cache keeps what was used last.

Changes to the set of cached hashes are reported to the ``KvEventLog`` right here, where they happen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv_events import KvEventLog


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is a prefix-cache entry


class BlockPool:
    def __init__(self, num_blocks: int, events: KvEventLog) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.events = events
        # Free blocks in eviction order (front first). OrderedDict: O(1) pop-front, append, remove.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """Takes ``count`` free blocks from the front of the queue, evicting their cached hashes."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        taken = [self._free.popitem(last=False)[1] for _ in range(count)]
        evicted = []
        for block in taken:
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
        self.events.removed(evicted)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds a reference to cached blocks (a prefix hit), taking free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block; blocks nobody uses any more join the free queue."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, blocks: list[KVBlock], block_hashes: list[int], parent_hash: int | None) -> None:
        """Makes full, computed blocks prefix-cache entries; ``parent_hash`` precedes block_hashes[0].

        A hash that another block already holds (two requests computed the same prefix in one step)
        is left to that block; this one stays uncached and is reused first once released.
        """
        run: list[int] = []  # consecutive hashes stored together, as one event
        run_parent = parent_hash
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                run.append(block_hash)
            else:
                self.events.stored(run, run_parent)
                run = []
                run_parent = block_hash
        self.events.stored(run, run_parent)
