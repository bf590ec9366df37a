"""Splitting a token frame into per-token pieces of text, and building a frame from pieces."""

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2
from chatmesh.token_text import coalesced, has_text_ends, merge_frames, token_pieces, tokens_frame


def frame(ids: list[int], text: str, ends: list[int]) -> engine_pb2.GenerateTokens:
    return engine_pb2.GenerateTokens(index=4, token_ids=ids, text=text, text_ends=ends)


def test_each_token_gets_the_text_between_its_end_and_the_previous_one():
    pieces = token_pieces(frame([7, 8, 9, 10], "Hello, world", [5, 5, 7, 12]))
    assert pieces == [(7, "Hello"), (8, ""), (9, ", "), (10, "world")]


def test_offsets_count_code_points_not_utf8_bytes():
    # "é" is 2 UTF-8 bytes and "🙂" 4, but one code point each.
    pieces = token_pieces(frame([1, 2, 3], "é🙂!", [1, 2, 3]))
    assert pieces == [(1, "é"), (2, "🙂"), (3, "!")]


def test_a_frame_without_ends_is_one_piece_released_by_its_last_token():
    assert token_pieces(frame([1, 2, 3], "abc", [])) == [(1, ""), (2, ""), (3, "abc")]


@pytest.mark.parametrize(
    "ends",
    [
        [1, 3],  # fewer ends than tokens
        [1, 2, 3, 3],  # more ends than tokens
        [2, 1, 3],  # decreasing
        [1, 2, 2],  # the last end short of the text
        [1, 2, 9],  # the last end past the text
    ],
)
def test_ends_that_do_not_fit_the_frame_make_it_one_piece_instead_of_raising(ends):
    assert not has_text_ends(frame([1, 2, 3], "abc", ends))
    assert token_pieces(frame([1, 2, 3], "abc", ends)) == [(1, ""), (2, ""), (3, "abc")]


@pytest.mark.parametrize("ends", [[3], [], [2], [7]], ids=["fits", "none", "short", "past"])
def test_a_one_token_frame_is_its_token_and_all_its_text_whatever_its_ends(ends):
    assert token_pieces(frame([42], "abc", ends)) == [(42, "abc")]


def test_a_frame_without_tokens_has_no_pieces():
    assert token_pieces(frame([], "", [])) == []


def test_a_frame_built_from_pieces_splits_back_into_them():
    pieces = [(5, "Grü"), (6, ""), (7, "ße 東"), (8, "京")]
    built = tokens_frame(9, pieces)
    assert (built.index, list(built.token_ids), built.text) == (9, [5, 6, 7, 8], "Grüße 東京")
    assert list(built.text_ends) == [3, 3, 7, 8] and has_text_ends(built)
    assert token_pieces(built) == pieces


def test_merged_frames_keep_every_token_piece_and_the_first_position():
    first = engine_pb2.GenerateTokens(index=4, token_ids=[1, 2], text="Hé", text_ends=[1, 2])
    second = engine_pb2.GenerateTokens(index=6, token_ids=[3], text="llo", text_ends=[3])
    merged = merge_frames([first, second])
    assert (merged.index, merged.text, list(merged.text_ends)) == (4, "Héllo", [1, 2, 5])
    assert token_pieces(merged) == token_pieces(first) + token_pieces(second)
    assert merge_frames([first]) is first


def test_a_frame_without_ends_merges_as_one_piece_released_by_its_last_token():
    merged = merge_frames([frame([1, 2], "ab", []), frame([3], "c", [1])])
    assert token_pieces(merged) == [(1, ""), (2, "ab"), (3, "c")] and has_text_ends(merged)


def test_coalescing_merges_each_run_of_token_frames_and_keeps_every_other_frame_in_place():
    def tokens(index: int, text: str) -> router_pb2.ResponseFrame:
        return router_pb2.ResponseFrame(
            tokens=engine_pb2.GenerateTokens(index=index, token_ids=[index], text=text, text_ends=[len(text)])
        )

    routed = router_pb2.ResponseFrame(routed=router_pb2.GenerateRouted(engine_id="e1"))
    finished = router_pb2.ResponseFrame(finished=engine_pb2.GenerateFinished())
    out = coalesced([tokens(0, "a"), tokens(1, "b"), routed, tokens(2, "c"), finished])
    assert [frame.WhichOneof("kind") for frame in out] == ["tokens", "routed", "tokens", "finished"]
    assert (out[0].tokens.text, list(out[0].tokens.token_ids)) == ("ab", [0, 1])
    assert out[2].tokens.index == 2 and out[3] is finished
