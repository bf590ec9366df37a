"""Envoy's chat routes (ring hash on the chat id) move a retry off a replica that has just died: through
the real Envoy to two ScriptedChatServers, one stopped while Envoy still counts it healthy (its health
checks here are a minute apart, so only retries and outlier detection can act)."""

from __future__ import annotations

from pathlib import Path

import grpc

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.identity import CHAT_ID_HEADER
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import start_front_door
from tests.front_door.scripted_chat_service import ScriptedChatServer

CHATS = [f"chat-{n}" for n in range(16)]  # keys the ring spreads over both replicas


def test_a_call_whose_chat_hashes_to_a_replica_that_died_is_retried_on_the_other(
    tmp_path: Path, dev_jwt_keys: DevKeys, two_replicas: tuple[ScriptedChatServer, ScriptedChatServer]
):
    dying, living = two_replicas
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        door = start_front_door(launcher, dev_jwt_keys, [dying.port, living.port], health_check_interval_s=60)
        auth = door.grpc_auth("retry-user")
        with grpc.insecure_channel(door.envoy.grpc_target) as channel:
            stub = chat_pb2_grpc.ChatServiceStub(channel)

            def calls(chat_id: str) -> None:
                metadata = (*auth, (CHAT_ID_HEADER, chat_id))
                stub.ListModels(chat_pb2.ListModelsRequest(), metadata=metadata, timeout=5)  # idempotent
                stub.CreateChat(chat_pb2.CreateChatRequest(), metadata=metadata, timeout=5)  # not

            for chat_id in CHATS:
                calls(chat_id)
            assert dying.service.calls_to("ListModels") and living.service.calls_to("ListModels")

            dying.stop()
            served = len(living.service.calls_to("ListModels")), len(living.service.calls_to("CreateChat"))
            failed = []
            for chat_id in CHATS:
                try:
                    calls(chat_id)
                except grpc.RpcError as error:
                    failed.append((chat_id, error.code(), error.details()))
            assert failed == []
            # Every call ran on the living replica, once (a call the dead one had never reached).
            assert len(living.service.calls_to("ListModels")) == served[0] + len(CHATS)
            assert len(living.service.calls_to("CreateChat")) == served[1] + len(CHATS)
