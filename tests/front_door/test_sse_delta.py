"""A chat page's delta event is written straight to bytes (edge/sse.py:delta_sse): it must be byte for
byte the event built and encoded whole, whatever the text."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from chatmesh.chat.v1 import chat_pb2
from edge.sse import delta_sse, run_event_sse

# Any code point but surrogates (which protobuf strings refuse), and the ones JSON or SSE treat apart.
TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",))),
    st.sampled_from(['"', "\\", "\r\n", "\r", "\n", "\u2028", "\x00", "🙂", "data: x\n\n"]),
)


@given(text=TEXTS, seq=st.integers(0, 2**64 - 1), token_count=st.integers(0, 2**32 - 1))
def test_a_delta_event_is_the_event_encoded_whole(text: str, seq: int, token_count: int) -> None:
    event = chat_pb2.RunEvent(seq=seq, delta=chat_pb2.Delta(text=text, token_count=token_count))
    sent = delta_sse(event)
    assert sent == run_event_sse(event).encode()
    lines = sent.decode().split("\r\n")
    assert lines[:2] == [f"id: {seq}", "event: delta"] and lines[3:] == ["", ""]
    assert json.loads(lines[2].removeprefix("data: ")) == {"text": text, "token_count": token_count}
