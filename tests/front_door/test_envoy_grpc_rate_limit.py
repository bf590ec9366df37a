"""What a gRPC caller gets when Envoy's per-user rate limit refuses it, as docs/api/grpc.md's error table
states: RESOURCE_EXHAUSTED with a ``RetryInfo`` in ``grpc-status-details-bin``, the same shape as the
orchestrator's own limits, so one handler serves both; the ``retry-after`` trailer too; and no call
reaching the chat service."""

from __future__ import annotations

import grpc
import pytest
from grpc_status import rpc_status

from chatmesh import errors
from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.fixtures.front_door import TEST_RATE_LIMITS
from tests.front_door.conftest import ScriptedFrontDoor


def test_a_rate_limited_grpc_call_is_resource_exhausted_with_a_retry_info(
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
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # When the caller's bucket has a token again: its refill interval, as RetryInfo and as the trailer.
    refill_s = TEST_RATE_LIMITS["api"].retry_after_s
    assert errors.retry_after_s(error) == refill_s
    assert dict(error.trailing_metadata())["retry-after"] == str(refill_s)
    # gRPC's own reader of rich statuses takes it: the details' code and message are the call's.
    status = rpc_status.from_call(error)
    assert status is not None and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    # A message to show a user, not Envoy's JSON body.
    assert "rate limit" in error.details() and "{" not in error.details()
    assert len(front_door.scripted.calls_to("ListChats")) == before
