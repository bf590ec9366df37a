"""A token's event is encoded once around a placeholder and filled in per token (edge/sse.py:TextEvent):
what it sends must be byte for byte the event built and encoded whole, whatever the text and whatever
the caller put in the fields before it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sse_starlette import ServerSentEvent

from chatmesh.chat.v1 import chat_pb2
from edge.openai_api import ChunkWriter
from edge.sse import TextEvent, compact_json

# Text a model or a caller can produce: any code point but surrogates (which protobuf strings refuse),
# the placeholder itself among them.
TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",))),
    st.sampled_from(["\x00text\x00", '"', "\\", "\r\n", "\u2028", "🙂"]),
)


@given(model=TEXTS, text=TEXTS, include_usage=st.booleans())
def test_a_content_chunk_is_the_chunk_encoded_whole(model: str, text: str, include_usage: bool) -> None:
    writer = ChunkWriter("chatcmpl-1", model, include_usage, tools=None)
    [sent] = writer.events(chat_pb2.RunEvent(seq=3, delta=chat_pb2.Delta(text=text)))
    assert sent == writer.chunk({"content": text}).encode()
    data = json.loads(sent.decode().removeprefix("data: ").removesuffix("\r\n\r\n"))
    assert data["choices"][0]["delta"] == {"content": text}
    assert data["model"] == model


def test_an_event_without_its_text_as_a_json_string_is_refused() -> None:
    with pytest.raises(ValueError):
        TextEvent(lambda text: ServerSentEvent(data=compact_json({"length": len(text)})))
