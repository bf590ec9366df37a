"""The rule for merging a stream's deltas, shared by the orchestrator (a follower that fell behind) and
the edge (events that arrived together on a shared stream): consecutive deltas travel as one event,
numbered as the last of them, so a client resuming after its seq misses nothing and repeats nothing."""

from __future__ import annotations

from collections.abc import Sequence

from chatmesh.chat.v1 import chat_pb2

# The most deltas one merged delta carries: a stream that attaches to a long answer gets what was made
# so far in a few messages whose size does not grow with max_tokens.
MAX_MERGED_DELTAS = 256


def merged_delta(
    last_seq: int,
    deltas: Sequence[tuple[str, int]],
    logprobs: Sequence[chat_pb2.TokenLogprob] = (),
) -> chat_pb2.RunEvent:
    """Consecutive deltas, given as (text, token count) and ending at ``last_seq``, as one event (with
    ``logprobs``, the deltas' own, in order)."""
    if len(deltas) == 1:
        text, token_count = deltas[0]
    else:
        text, token_count = "".join(text for text, _ in deltas), sum(count for _, count in deltas)
    delta = chat_pb2.Delta(text=text, token_count=token_count, logprobs=logprobs)
    return chat_pb2.RunEvent(seq=last_seq, delta=delta)
