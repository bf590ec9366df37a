"""``chatmesh.linked_calls``: the call a CompletionLinkService request stands for, and a unary call's
reply, the same for the edge and the orchestrator."""

from __future__ import annotations

import pytest
from google.protobuf.message_factory import GetMessageClass

from chatmesh.chat.v1 import chat_pb2, completion_link_pb2
from chatmesh.linked_calls import (
    UNARY_CALLS,
    linked_call,
    linked_reply,
    linked_start,
    method_of,
    reply_response,
)


def test_each_start_names_the_call_it_stands_for_and_carries_its_request():
    complete = chat_pb2.CompleteRequest(merge_deltas=True)
    send = chat_pb2.SendMessageRequest(chat_id="c", content="hi")
    regenerate = chat_pb2.RegenerateMessageRequest(chat_id="c", message_id="m")
    attach = chat_pb2.StreamRunRequest(run_id="r", after_seq=4)
    starts = [
        (completion_link_pb2.CompleteStart(request=complete), "Complete", complete),
        (completion_link_pb2.CompleteStart(send=send), "SendMessage", send),
        (completion_link_pb2.CompleteStart(regenerate=regenerate), "RegenerateMessage", regenerate),
        (completion_link_pb2.CompleteStart(stream_run=attach), "StreamRun", attach),
    ]
    for start, method, request in starts:
        name, carried = linked_call(start)
        assert name == f"chatmesh.chat.v1.CompletionLinkService/{method}"
        assert carried == request
        # And back: the start of the call ``method`` with ``request``.
        assert linked_start(method, "Bearer t", request) == completion_link_pb2.CompleteStart(
            authorization="Bearer t", **{start.WhichOneof("stored") or "request": request}
        )


def test_every_unary_call_of_chatservice_can_go_on_a_link_and_its_reply_carries_its_response():
    [service] = [s for s in chat_pb2.DESCRIPTOR.services_by_name.values() if s.name == "ChatService"]
    unary = {m.name for m in service.methods if not m.server_streaming}
    assert unary == UNARY_CALLS  # a unary call added to ChatService needs its start and reply fields
    for method in sorted(unary):
        rpc = service.methods_by_name[method]
        request = GetMessageClass(rpc.input_type)()
        name, carried = linked_call(linked_start(method, "Bearer t", request))
        assert name == f"chatmesh.chat.v1.CompletionLinkService/{method}"
        assert method_of(carried) == method
        response = GetMessageClass(rpc.output_type)()
        assert reply_response(method, linked_reply(method, response)) == response


def test_a_reply_that_carries_another_calls_response_is_refused():
    reply = linked_reply("GetRun", chat_pb2.GetRunResponse(run=chat_pb2.Run(run_id="r")))
    with pytest.raises(ValueError, match="CancelRun call carries get_run"):
        reply_response("CancelRun", reply)
    with pytest.raises(ValueError):
        reply_response("GetRun", completion_link_pb2.CallReply())
