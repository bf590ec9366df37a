"""Token frames as per-token pieces of text: chunking that depends on the tokens alone, not on timing.

An engine merges the steps a slow reader has not taken yet into one ``GenerateTokens`` frame, so how an
answer's tokens are grouped into frames depends on timing. ``text_ends`` lets a reader undo that: each
token's piece of text is ``text[text_ends[i-1]:text_ends[i]]`` (offsets in code points, which is what
Python indexes ``str`` by). A consumer that must number its events the same way on every replay (an
orchestrator that adopts a run and regenerates its tokens) splits every frame into these pieces.

A frame without ``text_ends`` (an engine that does not send them), or with ends that do not fit its text,
is one piece: its whole text is released by its last token. Bad ends from a peer never raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, groupby, pairwise
from typing import TypeVar

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2

# Each carries engine.v1's GenerateTokens as `tokens`.
Response = TypeVar("Response", engine_pb2.ResponseFrame, router_pb2.ResponseFrame)


def token_pieces(frame: engine_pb2.GenerateTokens) -> list[tuple[int, str]]:
    """(token id, the text that token released) for each of ``frame``'s tokens, in order."""
    ids, text = frame.token_ids, frame.text
    if len(ids) <= 1:  # most frames: a token that released all of the frame's text (ends or none)
        return [(ids[0], text)] if ids else []
    if not has_text_ends(frame):
        return [(token, "") for token in ids[:-1]] + [(ids[-1], text)]
    ends = list(frame.text_ends)
    starts = [0, *ends[:-1]]
    return [(token, text[start:end]) for token, start, end in zip(ids, starts, ends, strict=True)]


def tokens_frame(index: int, pieces: Sequence[tuple[int, str]]) -> engine_pb2.GenerateTokens:
    """The frame for ``pieces`` (as ``token_pieces`` returns them), output position ``index`` first."""
    return engine_pb2.GenerateTokens(
        index=index,
        token_ids=[token for token, _ in pieces],
        text="".join(piece for _, piece in pieces),
        text_ends=list(accumulate(len(piece) for _, piece in pieces)),
    )


def merge_frames(frames: Sequence[engine_pb2.GenerateTokens]) -> engine_pb2.GenerateTokens:
    """Consecutive frames as one, each token's piece of text and logprobs kept (the first frame's ``index``)."""
    if len(frames) == 1:
        return frames[0]
    merged = tokens_frame(frames[0].index, [piece for frame in frames for piece in token_pieces(frame)])
    for frame in frames:
        merged.logprobs.extend(frame.logprobs)
    return merged


def tokens_after(frame: engine_pb2.GenerateTokens, skip: int) -> engine_pb2.GenerateTokens:
    """``frame`` without its first ``skip`` tokens (their text and logprobs went out with them)."""
    rest = tokens_frame(frame.index + skip, token_pieces(frame)[skip:])
    rest.logprobs.extend(frame.logprobs[skip:])
    return rest


def coalesced(responses: Sequence[Response]) -> list[Response]:
    """``responses`` with each run of consecutive token frames merged into one frame (``merge_frames``):
    what a relay sends on when several arrived while it was busy."""
    out: list[Response] = []
    for are_tokens, group in groupby(responses, key=lambda response: response.WhichOneof("kind") == "tokens"):
        frames = list(group)
        if are_tokens and len(frames) > 1:
            out.append(type(frames[0])(tokens=merge_frames([frame.tokens for frame in frames])))
        else:
            out += frames
    return out


def has_text_ends(frame: engine_pb2.GenerateTokens) -> bool:
    """Whether ``frame`` carries per-token ends that fit it: one per token, never decreasing, the last
    one at the end of its text."""
    ends = frame.text_ends
    return (
        len(ends) == len(frame.token_ids) > 0
        and ends[-1] == len(frame.text)
        and all(earlier <= later for earlier, later in pairwise(ends))
    )
