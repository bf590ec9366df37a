"""Block pool and KV cache manager: ref counts, LRU eviction, hash-chain reuse, events and snapshots."""

import pytest

from chatmesh.block_hash import block_hashes
from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager
from engine.kv_events import BlocksRemoved, BlocksStored, KvEventLog, SubscriberOverflow, apply_events
from engine.request import EngineRequest, Request

BS = 4


def make_request(tokens: list[int]) -> Request:
    return Request(EngineRequest("r", tuple(tokens)), arrival=0.0, aging_s=10.0)


def computed(kv: KVCacheManager, tokens: list[int]) -> Request:
    """A sequence whose whole prompt was computed in one step (prefix hits taken first)."""
    s = make_request(tokens)
    hits = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, len(tokens) - len(hits) * BS, hits)
    s.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(s)
    return s


def manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, KvEventLog())


def test_shared_prefix_blocks_are_reused_and_ref_counted():
    kv = manager()
    a = computed(kv, list(range(10)))  # blocks [0-3], [4-7], partial [8, 9]
    b = make_request([*list(range(8)), 50, 51, 52])
    hits = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == a.block_table[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert [kv.pool.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert kv.num_used_blocks == 3


def test_the_hash_chain_stops_at_the_first_different_block():
    kv = manager()
    computed(kv, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    # Same second block, different first block: no reuse at all (chained hashes cover the prefix).
    assert kv.get_computed_blocks(make_request([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    assert len(kv.get_computed_blocks(make_request([1, 2, 3, 4, 5, 6, 7, 0, 9]))) == 1


def test_the_last_prompt_token_is_always_left_to_compute():
    kv = manager()
    tokens = list(range(12))  # exactly three blocks
    computed(kv, tokens)
    assert len(kv.get_computed_blocks(make_request(tokens))) == 2
    assert len(kv.get_computed_blocks(make_request([*tokens, 99]))) == 3


def test_hashes_are_the_shared_contracts_block_hashes():
    kv = manager()
    tokens = list(range(100, 111))
    computed(kv, tokens)
    assert kv.pool.cached_hashes() == set(block_hashes(tokens, BS))


def test_eviction_takes_the_least_recently_freed_cached_block_first():
    kv = manager(num_blocks=4)
    first = computed(kv, [1, 1, 1, 1, 1])  # block A (cached) + partial block
    second = computed(kv, [2, 2, 2, 2, 2])  # block B (cached) + partial block
    hash_a, hash_b = (
        kv.pool.blocks[first.block_table[0]].block_hash,
        kv.pool.blocks[second.block_table[0]].block_hash,
    )
    kv.free(first)
    kv.free(second)
    # Uncached partial blocks go first, then A (freed before B).
    third = make_request([3] * 9)
    assert kv.allocate_slots(third, 9)
    assert kv.pool.cached_hashes() == {hash_b}
    assert hash_a not in kv.pool.cached_hashes()


def test_a_prefix_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    kv = manager(num_blocks=3)
    first = computed(kv, [7] * 8)  # two cached blocks
    kv.free(first)
    again = make_request([7] * 8 + [1])
    hits = kv.get_computed_blocks(again)
    assert len(hits) == 2
    assert kv.allocate_slots(again, 1, hits)
    assert kv.num_used_blocks == 3
    assert not kv.allocate_slots(make_request([5] * 4), 4), "nothing free: the hit blocks are in use again"


def test_allocation_fails_without_side_effects_when_blocks_are_short():
    kv = manager(num_blocks=4)
    s = make_request(list(range(20)))
    assert not kv.allocate_slots(s, 20)
    assert s.block_table == [] and kv.num_used_blocks == 0


def test_reserve_keeps_blocks_free_for_running_requests():
    kv = manager(num_blocks=4)
    assert not kv.allocate_slots(make_request(list(range(16))), 16, reserve=1)
    assert kv.allocate_slots(make_request(list(range(12))), 12, reserve=1)


def test_two_blocks_with_one_hash_keep_the_first_and_the_duplicate_is_reused_first():
    log = KvEventLog()
    kv = KVCacheManager(8, BS, log)
    a, b = make_request([4] * 4 + [1]), make_request([4] * 4 + [2])
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)  # both prefill in the same step
    a.num_computed_tokens = b.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.cache_computed_blocks(b)
    shared_hash = block_hashes([4] * 4, BS)[0]
    assert log.flush().events == (BlocksStored((shared_hash,), None),)
    kv.free(a)
    kv.free(b)
    # Every uncached free block (b's duplicate included) goes before the one cached block.
    assert kv.allocate_slots(make_request(list(range(28))), 28)
    assert kv.pool.cached_hashes() == {shared_hash}


def test_events_report_stored_chains_and_evictions_in_step_batches():
    log = KvEventLog()
    kv = KVCacheManager(3, BS, log)
    tokens = list(range(8))
    s = computed(kv, tokens)
    h = block_hashes(tokens, BS)
    first = log.flush()
    assert first.sequence_number == 1
    assert first.events == (BlocksStored((h[0], h[1]), None),)
    assert log.flush() is None, "a step without changes uses no sequence number"

    # Extend the same sequence by one block: stored with its parent.
    s.token_ids += [8, 9, 10, 11]
    assert kv.allocate_slots(s, 4)
    s.num_computed_tokens = 12
    kv.cache_computed_blocks(s)
    h3 = block_hashes(list(range(12)), BS)[2]
    assert log.flush().events == (BlocksStored((h3,), h[1]),)

    kv.free(s)
    assert kv.allocate_slots(
        make_request([9] * 8), 8
    )  # evicts the two least recently freed: blocks 3, then 2
    removed = log.flush()
    assert removed.sequence_number == 3
    assert removed.events == (BlocksRemoved((h3, h[1])),)


def test_snapshot_plus_batches_replay_to_the_pools_hash_set():
    log = KvEventLog()
    kv = KVCacheManager(6, BS, log)
    live = [computed(kv, [i] * 9) for i in range(2)]
    log.flush()
    snapshot, sub = log.subscribe(lambda: None)
    assert snapshot.block_hashes == kv.pool.cached_hashes()
    for s in live:
        kv.free(s)
    for i in range(2, 6):
        kv.free(computed(kv, [i] * 9))
        log.flush()
    index = set(snapshot.block_hashes)
    batches = sub.take()
    assert [b.sequence_number for b in batches] == list(
        range(snapshot.sequence_number + 1, log.sequence_number + 1)
    )
    for b in batches:
        apply_events(index, b.events)
    assert index == kv.pool.cached_hashes()


def test_a_subscriber_that_falls_behind_is_cut_off_without_affecting_others():
    log = KvEventLog(subscriber_buffer=2)
    pool = BlockPool(16, log)
    wakes = []
    _, slow = log.subscribe(lambda: wakes.append("slow"))
    _, fast = log.subscribe(lambda: wakes.append("fast"))
    for i in range(3):
        [block] = pool.allocate(1)
        pool.cache([block], [1000 + i], None)
        log.flush()
        assert len(fast.take()) == 1
    with pytest.raises(SubscriberOverflow):
        slow.take()
    assert wakes.count("slow") == 2, "woken when it got data, and when it overflowed"
