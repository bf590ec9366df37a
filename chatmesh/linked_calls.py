"""What a CompletionLinkService request stands for, read one way by the edge that sends it and the
orchestrator that serves it: a call of ChatService's (a Complete, a stored chat's SendMessage,
RegenerateMessage or StreamRun, or a unary call) and that call's request, and a unary call's response
(its ``reply``)."""

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
# The CallReply field that carries each unary call's response (a `<Method>Response`).
_REPLY_FIELDS = {
    field.message_type.name.removesuffix("Response"): field.name
    for field in completion_link_pb2.CallReply.DESCRIPTOR.fields
    if field.message_type is not None
}
# The unary calls a request may stand for.
UNARY_CALLS = frozenset(_REPLY_FIELDS)


def method_of(request: Any) -> str:
    """The ChatService method whose request ``request`` is (a `<Method>Request`)."""
    return str(request.DESCRIPTOR.name).removesuffix("Request")


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
    return f"{_SERVICE}/{method_of(request)}", request


def linked_reply(method: str, response: Any) -> completion_link_pb2.CallReply:
    """The ``reply`` that carries the unary call ``method``'s response."""
    reply = completion_link_pb2.CallReply()
    getattr(reply, _REPLY_FIELDS[method]).CopyFrom(response)
    return reply


def reply_response(method: str, reply: completion_link_pb2.CallReply) -> Any:
    """The response of the unary call ``method`` that ``reply`` carries; ValueError when it carries
    another (or none)."""
    field = _REPLY_FIELDS[method]
    if reply.WhichOneof("response") != field:
        raise ValueError(f"the reply to a {method} call carries {reply.WhichOneof('response')}")
    return getattr(reply, field)
