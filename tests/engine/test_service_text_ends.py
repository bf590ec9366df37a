"""Per-token text boundaries (``GenerateTokens.text_ends``): the request tracker records what each token
released, and a ``RequestStream`` that merges the steps a slow reader has not taken keeps them right, so
the merged frame splits back into exactly the pieces the unmerged frames had."""

from collections.abc import Sequence

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.finish import FinishReason
from chatmesh.token_text import token_pieces
from engine.outputs import RequestOutput
from engine.request_tracker import RequestTracker, TrackedRequest
from engine.streams import RequestStream
from tests.engine.core_helpers import prompt, released_pieces, request, tokenizer

EMOJI_AND_CJK = "Grüße 東京 🙂 ok, ½ café"  # characters whose UTF-8 bytes span several tokens


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def tracked_request(
    tok, max_tokens: int, stop: tuple[str, ...] = ()
) -> tuple[RequestTracker, TrackedRequest]:
    tracker = RequestTracker(tok, release=lambda request_id: None)
    tracker.admit(request("r", prompt(6), max_tokens=max_tokens, stop=stop), limit=1)
    [tracked] = tracker.take_admitted()
    return tracker, tracked


def generate(tok, ids: list[int], steps: Sequence[int], stop: tuple[str, ...] = ()) -> list[RequestOutput]:
    """The outputs of a request whose steps produce ``steps[i]`` tokens each (a hosted backend's deltas
    may hold several), ending at max_tokens = len(ids) unless a stop string comes first."""
    tracker, tracked = tracked_request(tok, max_tokens=len(ids), stop=stop)
    outputs, at = [], 0
    for size in steps:
        outputs.append(output := tracker.add_tokens(tracked, ids[at : at + size]))
        at += size
        if output.finish is not None:
            break
    return outputs


def frame_of(*outputs: RequestOutput) -> engine_pb2.GenerateTokens:
    """What a client reads after ``outputs`` were delivered without it reading in between."""
    stream = RequestStream("r", lambda _: None)
    for output in outputs:
        stream.push(output)
    frame, _ = stream.take()
    assert frame is not None
    return frame


@pytest.mark.parametrize("steps", [[1] * 15, [3, 1, 4, 2, 5], [15]])
async def test_a_merged_frame_splits_back_into_the_pieces_of_the_unmerged_frames(tok, steps):
    ids = tok.encode(EMOJI_AND_CJK)
    outputs = generate(tok, ids, steps)
    unmerged = [piece for output in outputs for piece in token_pieces(frame_of(output))]
    merged = frame_of(*outputs)
    assert merged.text == EMOJI_AND_CJK and len(merged.text_ends) == len(ids)
    assert token_pieces(merged) == unmerged == released_pieces(tok, ids)


async def test_bytes_of_an_unfinished_character_release_nothing_until_its_last_token(tok):
    ids = tok.encode(EMOJI_AND_CJK)
    pieces = token_pieces(frame_of(*generate(tok, ids, [2] * 8)))
    held = [i for i, (_, piece) in enumerate(pieces) if piece == ""]
    assert held, "the test text must hold bytes back"
    for i in held:  # the next token releases the whole character, never a part of it
        assert pieces[i + 1][1] and "\ufffd" not in pieces[i + 1][1]
    assert "".join(piece for _, piece in pieces) == EMOJI_AND_CJK


async def test_a_possible_stop_string_is_held_back_then_released_by_the_token_that_rules_it_out(tok):
    ids = tok.encode(" the lazy cat and the lazy dog ran")
    outputs = generate(tok, ids, [4, 3, 5, 4], stop=("lazy dog",))
    pieces = token_pieces(frame_of(*outputs))
    assert pieces == released_pieces(tok, ids, stop=("lazy dog",))
    # " lazy" releases its space and holds "lazy" back until " cat" rules "lazy dog" out; " dog" matches.
    assert [piece for _, piece in pieces] == [" the", " ", "lazy cat", " and", " the", " ", ""]
    finish = outputs[-1].finish
    assert finish is not None and finish.reason is FinishReason.STOP and finish.matched_stop == "lazy dog"


async def test_text_held_for_a_stop_string_at_the_last_token_comes_with_the_finish(tok):
    ids = tok.encode(" the lazy cat and the lazy")
    outputs = generate(tok, ids, [len(ids)], stop=("lazy dog",))
    [output] = outputs
    pieces = token_pieces(frame_of(output))
    assert pieces[-1] == (ids[-1], " "), "'lazy' may start the stop string: the last token holds it back"
    assert output.finish is not None and output.finish.reason is FinishReason.LENGTH
    assert output.finish.text == "lazy"
    assert "".join(piece for _, piece in pieces) + output.finish.text == " the lazy cat and the lazy"
