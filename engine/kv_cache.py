"""The scheduler's view of KV memory: prefix hits, room for new tokens, caching computed blocks, freeing.

Block hashes come from ``chatmesh.block_hash`` (the contract with the router) and cover the whole
sequence, prompt and output alike. A block becomes a prefix-cache entry only after a step has computed
its KV, so a prefix hit never points at KV that is still being written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chatmesh.block_hash import BLOCK_HASH_SEED, block_hashes
from engine.block_pool import BlockPool, KVBlock
from engine.config import EngineConfig
from engine.kv_events import KvEventLog
from engine.request import Request


def size_kv_pool(config: EngineConfig, context_length: int, bytes_per_block: int) -> int:
    """Number of KV blocks: the configured count, or as many as the memory budget holds."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if bytes_per_block == 0:
        # A runner that holds no KV memory (null): room for every running request's full context.
        return config.max_running_requests * math.ceil(context_length / config.block_size)
    return max(1, int(config.kv_memory_gib * 2**30) // bytes_per_block)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        events: KvEventLog,
        enable_prefix_caching: bool = True,
        hash_seed: int = BLOCK_HASH_SEED,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.pool = BlockPool(num_blocks, events)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """The longest cached prefix of ``req``'s tokens, in whole blocks.

        At least the last token is always left to compute: its logits pick the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        count = (req.num_tokens - 1) // self.block_size
        for block_hash in self._hashes(req, count)[:count]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: Sequence[KVBlock] = (), reserve: int = 0
    ) -> bool:
        """Gives ``req`` blocks for ``num_new_tokens`` more tokens after its computed ones (and the
        prefix hits ``computed``, only for a request that holds no blocks yet). False, and nothing
        changed, when that would leave fewer than ``reserve`` blocks free."""
        if computed and req.block_table:
            raise ValueError("prefix hits are taken only by a request without blocks")
        num_tokens = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = math.ceil(num_tokens / self.block_size) - len(req.block_table) - len(computed)
        free = self.pool.num_free_blocks - sum(1 for block in computed if block.ref_count == 0)
        if needed > free - reserve:
            return False
        if computed:
            self.pool.touch(computed)
            req.block_table = [block.block_id for block in computed]
            req.num_stored_blocks = len(computed)
        if needed > 0:
            req.block_table += [block.block_id for block in self.pool.allocate(needed)]
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """After a step: ``req``'s full blocks whose KV is now computed become prefix-cache entries."""
        full = req.num_computed_tokens // self.block_size
        start = req.num_stored_blocks
        if not self.enable_prefix_caching or full <= start:
            return
        hashes = self._hashes(req, full)
        blocks = [self.pool.blocks[i] for i in req.block_table[start:full]]
        self.pool.cache(blocks, hashes[start:full], hashes[start - 1] if start else None)
        req.num_stored_blocks = full

    def free(self, req: Request) -> None:
        """Releases all of ``req``'s blocks, last block first: its tail is the least likely to be shared,
        so it should be evicted first."""
        self.pool.release(self.pool.blocks[i] for i in reversed(req.block_table))
        req.block_table = []
        req.num_stored_blocks = 0

    def _hashes(self, req: Request, count: int) -> list[int]:
        """``req.block_hashes`` extended to cover its first ``count`` full blocks."""
        have, size = len(req.block_hashes), self.block_size
        if have < count:
            parent = req.block_hashes[-1] if have else None
            tokens = req.token_ids[have * size : count * size]
            req.block_hashes += block_hashes(tokens, size, self.hash_seed, parent)
        return req.block_hashes
