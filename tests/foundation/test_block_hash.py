from array import array

from chatmesh.block_hash import BLOCK_HASH_SEED, block_hashes, hash_block

TOKENS = list(range(1000, 1040))


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(TOKENS, block_size=16)) == 2
    assert block_hashes(TOKENS[:15], block_size=16) == []


def test_hash_is_chained_so_equal_blocks_after_different_prefixes_differ():
    a = block_hashes([1] * 16 + [7] * 16, block_size=16)
    b = block_hashes([2] * 16 + [7] * 16, block_size=16)
    assert a[1] != b[1]


def test_shared_prefix_gives_shared_hashes():
    a = block_hashes(TOKENS[:32] + [5] * 16, block_size=16)
    b = block_hashes(TOKENS[:32] + [6] * 16, block_size=16)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_continuing_a_chain_equals_hashing_the_whole_sequence():
    whole = block_hashes(TOKENS, block_size=8)
    head = block_hashes(TOKENS[:16], block_size=8)
    tail = block_hashes(TOKENS[16:], block_size=8, parent=head[-1])
    assert head + tail == whole


def test_seed_and_block_size_change_the_hashes():
    assert block_hashes(TOKENS, 16) != block_hashes(TOKENS, 16, seed=BLOCK_HASH_SEED + 1)
    assert block_hashes(TOKENS, 16)[0] != block_hashes(TOKENS, 8)[1]


def test_first_block_differs_from_a_block_whose_parent_hash_is_zero():
    assert hash_block(None, TOKENS[:16]) != hash_block(0, TOKENS[:16])


def test_hash_values_are_frozen():
    # The hash is a cross-process, cross-version contract: engines and routers of different builds must
    # agree. If this fails, the hash changed — that breaks every deployed router's index.
    assert block_hashes(list(range(16)), block_size=16) == [0x7382D0FAECC1F834]


def test_a_sequence_hashes_as_its_blocks_chained_whatever_holds_its_ids():
    chained, parent = [], None
    for start in range(0, 40 - 40 % 8, 8):
        parent = hash_block(parent, TOKENS[start : start + 8])
        chained.append(parent)
    assert block_hashes(TOKENS, 8) == chained
    assert block_hashes(array("I", TOKENS), 8) == chained  # the router keeps prompts as arrays
