"""What a CompletionLinkService request stands for, read one way by the edge that sends it and the
orchestrator that serves it: a call of ChatService's (a Complete, or a stored chat's SendMessage,
RegenerateMessage or StreamRun) and that call's request."""

from __future__ import annotations

from typing import Any

from chatmesh.chat.v1 import completion_link_pb2

_SERVICE = completion_link_pb2.DESCRIPTOR.services_by_name["CompletionLinkService"].full_name
# The CompleteStart field that carries each call's request (a `<Method>Request`), read off the proto.
_START_FIELDS = {
    field.message_type.name.removesuffix("Request"): field.name
    for field in completion_link_pb2.CompleteStart.DESCRIPTOR.fields
    if field.message_type is not None
}


def linked_start(method: str, authorization: str, request: Any) -> completion_link_pb2.CompleteStart:
    """The start of a request that stands for the ChatService call ``method`` with ``request``, made by
    the caller whose `authorization` value it carries."""
    start = completion_link_pb2.CompleteStart(authorization=authorization)
    getattr(start, _START_FIELDS[method]).CopyFrom(request)
    return start


def linked_call(start: completion_link_pb2.CompleteStart) -> tuple[str, Any]:
    """The name of the call ``start`` stands for (``CompletionLinkService/SendMessage``: its spans'
    name, as a Complete's is ``…/Complete``) and its request."""
    request = getattr(start, start.WhichOneof("stored") or "request")
    return f"{_SERVICE}/{request.DESCRIPTOR.name.removesuffix('Request')}", request
