"""``chatmesh.linked_calls``: the call a CompletionLinkService request stands for, the same for the edge
and the orchestrator."""

from __future__ import annotations

from chatmesh.chat.v1 import chat_pb2, completion_link_pb2
from chatmesh.linked_calls import linked_call, linked_start


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
