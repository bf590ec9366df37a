"""What a gRPC caller gets when Envoy's per-user rate limit refuses it, as docs/api/grpc.md's error table
states: UNAVAILABLE (Envoy's mapping of its 429), a ``retry-after`` trailer in seconds, and no call
reaching the chat service. RESOURCE_EXHAUSTED with a RetryInfo is what the orchestrator's own limits
answer; Envoy's local rate limit does not speak google.rpc details."""

from __future__ import annotations

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.front_door.conftest import ScriptedFrontDoor


def test_a_rate_limited_grpc_call_is_unavailable_with_a_retry_after_trailer(
    front_door: ScriptedFrontDoor, user: str
):
    metadata = (("authorization", f"Bearer {front_door.envoy.token(user, 'free')}"),)
    with grpc.insecure_channel(front_door.envoy.grpc_target) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        for _ in range(8):  # the test config's free-tier burst on the api routes
            stub.ListChats(chat_pb2.ListChatsRequest(), metadata=metadata, timeout=5)
        before = len(front_door.scripted.calls_to("ListChats"))
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListChats(chat_pb2.ListChatsRequest(), metadata=metadata, timeout=5)
    error = refused.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "local_rate_limited" in error.details()
    assert int(dict(error.trailing_metadata())["retry-after"]) >= 1
    assert len(front_door.scripted.calls_to("ListChats")) == before
