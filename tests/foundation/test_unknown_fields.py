"""Fields a request carries that this build's protos do not define are found, at any depth."""

from __future__ import annotations

from chatmesh.chat.v1 import chat_pb2
from chatmesh.unknown_fields import unknown_field

# Field 99 as a varint (tag (99 << 3) | 0, then the value 1): what a newer client's field looks like here.
FIELD_99 = b"\x98\x06\x01"


def test_a_known_request_has_none():
    request = chat_pb2.CompleteRequest(
        messages=[chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="hi")],
        options=chat_pb2.GenerationOptions(max_tokens=3, logit_bias={5: 1.0}),
    )
    assert unknown_field(chat_pb2.CompleteRequest.FromString(request.SerializeToString())) is None


def test_unknown_fields_are_found_at_the_top_in_a_message_and_in_a_list():
    top = chat_pb2.GetRunRequest.FromString(chat_pb2.GetRunRequest(run_id="r").SerializeToString() + FIELD_99)
    assert unknown_field(top) == ("", 99)
    nested = chat_pb2.SendMessageRequest(content="hi")
    nested.options.MergeFromString(FIELD_99)
    assert unknown_field(chat_pb2.SendMessageRequest.FromString(nested.SerializeToString())) == (
        "options",
        99,
    )
    listed = chat_pb2.CompleteRequest(
        messages=[chat_pb2.PromptMessage(content="a"), chat_pb2.PromptMessage()]
    )
    listed.messages[1].MergeFromString(FIELD_99)
    assert unknown_field(listed) == ("messages[1]", 99)
