"""The block-hash index: leading-prefix matches per engine, driven only by stored/removed/cleared."""

from chatmesh.block_hash import block_hashes
from router.index import PrefixIndex

PROMPT = list(range(100, 260))  # 160 tokens: 10 blocks of 16


def index_with(*engines: str, max_blocks: int = 1000) -> PrefixIndex:
    index = PrefixIndex()
    for engine in engines:
        index.add_engine(engine, max_blocks)
    return index


def test_match_counts_each_engines_leading_run_of_blocks():
    hashes = block_hashes(PROMPT)
    index = index_with("a", "b", "c")
    index.store("a", hashes[:3])
    index.store("b", hashes[:7])
    index.store("c", hashes[1:8])  # no first block: no prefix at all
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 3, "b": 7, "c": 0}


def test_match_of_a_fully_cached_prompt_and_of_unknown_engines():
    hashes = block_hashes(PROMPT)
    index = index_with("a")
    index.store("a", hashes)
    assert index.match(hashes, ["a", "never-added"]) == {"a": 10}
    assert index.match([], ["a"]) == {"a": 0}


def test_a_hole_in_the_chain_ends_the_prefix():
    hashes = block_hashes(PROMPT)
    index = index_with("a")
    index.store("a", hashes)
    index.remove("a", [hashes[4]])
    assert index.match(hashes, ["a"]) == {"a": 4}


def test_removal_on_one_engine_leaves_the_others():
    hashes = block_hashes(PROMPT)
    index = index_with("a", "b")
    index.store("a", hashes)
    index.store("b", hashes)
    index.remove("a", hashes[2:])
    assert index.match(hashes, ["a", "b"]) == {"a": 2, "b": 10}
    assert (index.size("a"), index.size("b")) == (2, 10)


def test_clear_and_replace_forget_everything_the_engine_held():
    hashes = block_hashes(PROMPT)
    other = block_hashes(list(range(5000, 5064)))
    index = index_with("a", "b")
    index.store("a", hashes)
    index.store("b", hashes[:2])
    index.clear("a")
    assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 2}
    index.replace("b", other)
    assert index.match(hashes, ["b"]) == {"b": 0}
    assert index.match(other, ["b"]) == {"b": 4} and index.size("b") == 4


def test_each_engine_is_bounded_and_extra_blocks_are_not_indexed():
    hashes = block_hashes(PROMPT)
    index = index_with("a", max_blocks=4)
    index.store("a", hashes)
    assert index.size("a") == 4 and index.dropped == 6
    assert index.match(hashes, ["a"]) == {"a": 4}
    index.remove("a", hashes[:2])
    index.store("a", hashes[:2])  # room again after removals
    assert index.size("a") == 4


def test_a_removed_engine_frees_its_slot_and_entries():
    hashes = block_hashes(PROMPT)
    index = index_with("a", "b")
    index.store("a", hashes)
    index.remove_engine("a")
    index.add_engine("c", 100)  # takes a's slot: must not inherit its blocks
    assert index.match(hashes, ["a", "b", "c"]) == {"b": 0, "c": 0}


def test_a_shared_prefix_then_each_engine_its_own_run():
    # The walk narrows the holders block by block, then follows the last one alone to its first gap.
    hashes = block_hashes(PROMPT)
    index = index_with("a", "b", "c")
    index.store("a", hashes[:7] + hashes[8:])  # its history has a hole at block 7
    index.store("b", hashes[:4])  # the shared system prompt only
    index.store("c", hashes[:6])
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 7, "b": 4, "c": 6}
    index.remove_engine("a")
    index.add_engine("d", 100)  # a's slot, with a held set of its own
    index.store("d", hashes[:5])
    assert index.match(hashes, ["b", "c", "d"]) == {"b": 4, "c": 6, "d": 5}
